//! The handles C holds (`refit_group*`, `refit_plan*`, ...): ids in one process-wide registry, never
//! addresses of Rust objects.
//!
//! C's handle mistakes are the ones no compiler catches: a handle destroyed twice, used after its
//! destroy, cast to another handle type, or destroyed while another thread's call is still using
//! it. Were handles addresses, each would be a use-after-free or a read of the wrong type. As ids,
//! each is a status instead:
//! - an id is never reused in a process (`crate::ids`), so a destroyed handle stays unknown whatever
//!   was created since, and a made-up value names nothing (INVALID_ARGUMENT naming the argument);
//! - the registry knows each handle's type, so a handle of another type is INVALID_ARGUMENT too;
//! - a call holds the handles it was passed (a reference count) until it returns, and a destroy
//!   releases a handle only when no call holds it: otherwise the destroy is refused and the handle
//!   stays live, so no call ever sees its object freed underneath it.
//!
//! A lookup is a read lock and a hash probe, tens of nanoseconds beside a call's microseconds.

use super::boundary;
use crate::bail;
use crate::error::{Result, Status};
use crate::sync::{read, write};
use std::any::{type_name, Any};
use std::collections::hash_map::Entry::Occupied;
use std::collections::HashMap;
use std::sync::{Arc, LazyLock, RwLock};

/// A handle's object, with the C name of its type for messages.
struct Entry {
    object: Arc<dyn Any + Send + Sync>,
    kind: &'static str,
}

/// Live handles by id.
static LIVE: LazyLock<RwLock<HashMap<usize, Entry>>> = LazyLock::new(Default::default);

/// The C name of a handle type: its Rust name without the module path (`refit_group`).
fn kind_of<T>() -> &'static str {
    let full = type_name::<T>();
    full.rsplit("::").next().unwrap_or(full)
}

/// Registers `object` and returns the handle C gets for it.
pub(crate) fn publish<T: Any + Send + Sync>(object: T) -> *mut T {
    let id = crate::ids::issue() as usize;
    write(&LIVE).insert(id, Entry { object: Arc::new(object), kind: kind_of::<T>() });
    id as *mut T
}

/// The object of a live handle of type `T`, held until the returned reference drops. `what` names
/// the argument in the messages: NULL_ARGUMENT for NULL, INVALID_ARGUMENT for a value that is no
/// live handle of this type.
pub(crate) fn live<T: Any + Send + Sync>(handle: *const T, what: &str) -> Result<Arc<T>> {
    let id = handle as usize;
    if id == 0 {
        bail!(Status::NullArgument, "{what} is NULL");
    }
    let found = read(&LIVE).get(&id).map(|entry| (Arc::clone(&entry.object), entry.kind));
    match found {
        None => bail!(
            Status::InvalidArgument,
            "{what} ({id:#x}) is not a live {}: destroyed already, or never returned by refit",
            kind_of::<T>()
        ),
        Some((object, kind)) => object.downcast::<T>().map_err(|_| {
            crate::error::Error::invalid_argument(format!("{what} is a {kind}, not a {}", kind_of::<T>()))
        }),
    }
}

/// Takes a live handle of type `T` out of the registry, if no call holds it; the caller drops the
/// object (outside the registry's lock: dropping a group joins its threads, which may call in).
fn retire<T: Any + Send + Sync>(handle: *mut T) -> Result<Arc<dyn Any + Send + Sync>> {
    let id = handle as usize;
    let mut handles = write(&LIVE);
    let Occupied(slot) = handles.entry(id) else {
        bail!(
            Status::InvalidArgument,
            "{id:#x} is not a live {}: destroyed already, or never returned by refit; nothing was released",
            kind_of::<T>()
        );
    };
    let entry = slot.get();
    if !entry.object.is::<T>() {
        bail!(
            Status::InvalidArgument,
            "{id:#x} is a {}, not a {}; nothing was released",
            entry.kind,
            kind_of::<T>()
        );
    }
    // Every other holder is a call in progress: it got its reference under this lock's read side,
    // so none can appear while the write side is held.
    if Arc::strong_count(&entry.object) > 1 {
        bail!(
            Status::InvalidState,
            "the {} is in use by a call in progress (on another thread, or the call whose callback \
             this is); it was left alive: destroy it after that call returns",
            entry.kind
        );
    }
    Ok(slot.remove().object)
}

/// Releases a handle (NULL is ignored); every `*_destroy` export is this. A destroy cannot return a
/// status, so a refusal (not a live handle of this type, or in use by a call) is logged as an error
/// and kept as the thread's last error message, and nothing is released.
pub(crate) fn destroy<T: Any + Send + Sync>(handle: *mut T, name: &str) {
    if handle.is_null() {
        return;
    }
    let _ = boundary(name, || match retire(handle) {
        Ok(object) => {
            drop(object);
            Ok(())
        }
        Err(refusal) => {
            log::error!("{name}: {}", refusal.message);
            Err(refusal)
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Widget(u32);
    struct Gadget;

    #[test]
    fn a_handle_resolves_to_its_object_until_destroyed_and_never_after() {
        let handle = publish(Widget(7));
        assert_eq!(live(handle, "w").unwrap().0, 7);
        destroy(handle, "widget_destroy");
        let err = live(handle, "w").err().unwrap();
        assert_eq!(err.status, Status::InvalidArgument);
        assert!(err.message.contains("not a live Widget"), "{}", err.message);
        // A second destroy is refused, and a new handle never takes the old id.
        destroy(handle, "widget_destroy");
        assert!(crate::error::last_error().contains("destroyed already"));
        let next = publish(Widget(8));
        assert_ne!(next, handle);
        assert!(live(handle, "w").is_err());
        destroy(next, "widget_destroy");
    }

    #[test]
    fn a_handle_of_another_type_is_refused_by_calls_and_by_destroy() {
        let gadget = publish(Gadget);
        let as_widget = gadget as *mut Widget;
        let err = live(as_widget, "w").err().unwrap();
        assert_eq!(
            (err.status, err.message.as_str()),
            (Status::InvalidArgument, "w is a Gadget, not a Widget")
        );
        destroy(as_widget, "widget_destroy");
        assert!(crate::error::last_error().contains("is a Gadget, not a Widget; nothing was released"));
        assert!(live(gadget, "g").is_ok());
        destroy(gadget, "gadget_destroy");
    }

    #[test]
    fn a_destroy_while_a_call_holds_the_handle_is_refused_and_the_object_lives() {
        let handle = publish(Widget(1));
        let held = live(handle, "w").unwrap();
        destroy(handle, "widget_destroy");
        assert!(crate::error::last_error().contains("in use by a call in progress"));
        assert_eq!(held.0, 1);
        drop(held);
        destroy(handle, "widget_destroy");
        assert!(live(handle, "w").is_err());
    }

    #[test]
    fn threads_racing_calls_against_a_destroy_never_see_the_object_go_under_them() {
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        struct Counted(u64);
        impl Drop for Counted {
            fn drop(&mut self) {
                DROPS.fetch_add(1, Ordering::SeqCst);
            }
        }
        // A handle is a plain value to C; threads share it as one.
        let id = publish(Counted(42)) as usize;
        let handle = || id as *mut Counted;
        std::thread::scope(|threads| {
            for _ in 0..4 {
                threads.spawn(|| loop {
                    match live(handle(), "c") {
                        // Held: not dropped, whatever the destroying thread does meanwhile.
                        Ok(held) => assert_eq!((held.0, DROPS.load(Ordering::SeqCst)), (42, 0)),
                        Err(gone) => break assert_eq!(gone.status, Status::InvalidArgument),
                    }
                });
            }
            threads.spawn(|| {
                while live(handle(), "c").is_ok() {
                    destroy(handle(), "counted_destroy");
                }
                // The destroy that succeeded dropped the object itself, once, before returning.
                assert_eq!(DROPS.load(Ordering::SeqCst), 1);
            });
        });
        assert_eq!(DROPS.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn threads_creating_using_and_destroying_their_own_handles_never_meet() {
        std::thread::scope(|threads| {
            for t in 0..4u32 {
                threads.spawn(move || {
                    for i in 0..2000 {
                        let handle = publish(Widget(t * 10_000 + i));
                        assert_eq!(live(handle, "w").unwrap().0, t * 10_000 + i);
                        destroy(handle, "widget_destroy");
                        assert!(live(handle, "w").is_err());
                    }
                });
            }
        });
    }

    #[test]
    fn null_and_made_up_values_are_refused() {
        assert_eq!(live(std::ptr::null::<Widget>(), "w").err().unwrap().status, Status::NullArgument);
        for made_up in [0x1usize, 0x8, 0xdead_beef, usize::MAX] {
            assert_eq!(live(made_up as *const Widget, "w").err().unwrap().status, Status::InvalidArgument);
        }
    }
}
