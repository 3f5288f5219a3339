//! Executor hooks the host and GPU executor tests share.

use refit::exec::{Hook, Stage};
use refit::group::Group;
use refit::{Error, Status};
use std::sync::Arc;

/// A hook that fails at `at`, standing for a driver error there.
pub fn failing_at(at: Stage) -> Hook {
    Arc::new(
        move |stage, _group: &Group| {
            if stage == at {
                Err(Error::new(Status::CudaError, "injected failure"))
            } else {
                Ok(())
            }
        },
    )
}
