//! Arguments every rank of a collective call must pass alike (an allgather's counts), compared before
//! any byte of the call moves, so that ranks which passed other arguments get a refusal naming them
//! while the connections stay in step and the communicator stays usable.

use super::super::mesh::some_ranks;
use crate::error::Error;

/// One rank's side of an agreement.
#[derive(Clone, Debug)]
pub struct Agreement {
    /// A digest of the arguments that must be alike.
    pub digest: u64,
    /// What they are, for messages ("counts").
    pub what: &'static str,
    /// This rank's arguments as a message shows them.
    pub mine: String,
}

impl Agreement {
    /// `None` when every rank passed this digest; else the refusal for rank `rank`, naming the
    /// ranks that differ from the arguments most ranks passed (on a tie, those of the lowest rank
    /// among them), so that every rank names the same ranks.
    pub(crate) fn verdict(&self, rank: usize, digests: &[u64]) -> Option<Error> {
        if digests.iter().all(|&d| d == self.digest) {
            return None;
        }
        let holders = |digest: u64| digests.iter().filter(|&&d| d == digest).count();
        let reference = digests
            .iter()
            .enumerate()
            .max_by_key(|&(first, &d)| (holders(d), std::cmp::Reverse(first)))
            .map(|(_, &d)| d)
            .expect("at least this rank");
        let differing: Vec<usize> = (0..digests.len()).filter(|&p| digests[p] != reference).collect();
        let agreeing = digests.len() - differing.len();
        Some(Error::invalid_argument(format!(
            "the ranks passed different {}: {} differ from the other {} (this rank, {rank}, passed {}); \
             nothing moved, and the communicator stays usable",
            self.what,
            some_ranks(differing.iter().copied(), differing.len()),
            some_ranks((0..digests.len()).filter(|&p| digests[p] == reference), agreeing),
            self.mine
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn agreement(digest: u64) -> Agreement {
        Agreement { digest, what: "counts", mine: format!("<{digest}>") }
    }

    #[test]
    fn every_rank_names_the_same_ranks() {
        assert!(agreement(5).verdict(1, &[5, 5, 5]).is_none());
        let digests = [5, 7, 5];
        for rank in 0..3 {
            let err = agreement(digests[rank]).verdict(rank, &digests).unwrap();
            assert!(err.message.contains("counts: ranks [1] differ from the other ranks [0, 2]"), "{err}");
            assert!(err.message.contains(&format!("this rank, {rank}, passed <{}>", digests[rank])), "{err}");
        }
        // A tie: the lowest rank's arguments are the reference.
        let err = agreement(9).verdict(1, &[8, 9]).unwrap();
        assert!(err.message.contains("ranks [1] differ from the other ranks [0]"), "{err}");
    }
}
