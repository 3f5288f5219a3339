//! Arbitrary bytes read as the values a fuzz target needs: mostly small, sometimes extreme. Shared
//! by the targets (each includes this file as a module and uses what it needs).
#![allow(dead_code)]

pub struct Bytes<'a>(pub &'a [u8]);

impl Bytes<'_> {
    /// The next byte; 0 once the input is used up.
    pub fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&b, rest)) => {
                self.0 = rest;
                b
            }
            None => 0,
        }
    }

    /// Mostly below `small` (at most 255); 0xff prefixes an extreme value.
    pub fn value(&mut self, small: u64) -> u64 {
        match self.byte() {
            0xff => u64::MAX >> (self.byte() % 64),
            b => u64::from(b) % small.max(1),
        }
    }

    /// Below `n`, never extreme (offsets into memory the target owns).
    pub fn small(&mut self, n: u64) -> u64 {
        u64::from(self.byte()) % n.max(1)
    }

    /// `n` values, each as [`Bytes::value`].
    pub fn list(&mut self, n: usize, small: u64) -> Vec<u64> {
        (0..n).map(|_| self.value(small)).collect()
    }
}
