//! Fallible allocation for what the caller's tables size: a plan that does not fit in memory is
//! OUT_OF_MEMORY with a message, never an abort of the caller's process. Every planner buffer that
//! grows with the input or the output (entries, pieces, items, segments, runs) is allocated here.

use crate::error::{Error, Result, Status};

fn out_of_memory<T>(count: usize, what: &str) -> Error {
    let bytes = (count as u128) * (std::mem::size_of::<T>() as u128);
    Error::new(Status::OutOfMemory, format!("cannot allocate {bytes} bytes for {count} {what}"))
}

/// An empty vector with room for `count` values.
pub(crate) fn with_capacity<T>(count: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(count).map_err(|_| out_of_memory::<T>(count, what))?;
    Ok(v)
}

/// `count` copies of `value`.
pub(crate) fn filled<T: Clone>(value: T, count: usize, what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(count, what)?;
    v.resize(count, value);
    Ok(v)
}

/// Room for `more` values beyond `v.len()` (growing geometrically, as `push` would).
pub(crate) fn reserve<T>(v: &mut Vec<T>, more: usize, what: &str) -> Result<()> {
    v.try_reserve(more).map_err(|_| out_of_memory::<T>(v.len().saturating_add(more), what))
}

/// Appends `value`.
#[inline]
pub(crate) fn push<T>(v: &mut Vec<T>, value: T, what: &str) -> Result<()> {
    if v.len() == v.capacity() {
        reserve(v, 1, what)?;
    }
    v.push(value);
    Ok(())
}

/// A vector of everything `values` yields, allocated once for `count` values (more grow fallibly).
pub(crate) fn collect<T>(count: usize, values: impl Iterator<Item = T>, what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(count, what)?;
    for value in values {
        push(&mut v, value, what)?;
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn impossible_sizes_are_out_of_memory() {
        let err = with_capacity::<u64>(usize::MAX / 4, "runs").unwrap_err();
        assert_eq!(err.status, Status::OutOfMemory);
        assert!(err.message.contains("runs"), "{err}");
        let mut v = vec![1u64];
        assert_eq!(reserve(&mut v, usize::MAX / 4, "segments").unwrap_err().status, Status::OutOfMemory);
        assert_eq!(filled(0u8, 3, "flags").unwrap(), vec![0, 0, 0]);
        assert_eq!(collect(1, 0..4u8, "values").unwrap(), vec![0, 1, 2, 3]);
    }
}
