//! Plans across processes: each process adds only its own table, the encoded tables are gathered
//! over a communicator, every process builds its share of one plan (`plan::build_share`: the routes
//! from or to its own endpoints, with owners chosen as a deterministic function of all tables and the
//! options, so the shares fit together), and the processes agree before any byte moves.
//!
//! Agreement: every rank sends the others a short record (its build's status and message, and
//! fingerprints of the gathered tables, the planner's inputs (tables, options, limits) and the
//! library version). Every rank then decides the same way from the same records: a rank whose build
//! failed returns its own error and the others ABORTED naming it; any fingerprint that differs
//! between ranks (options passed differently, another library version) is INVALID_ARGUMENT on every
//! rank, naming both sides. So a disagreement is a status everywhere, never a hang and never a plan
//! installed on some ranks only.

use crate::bail;
use crate::error::{Error, Result, Status};
use crate::plan::{self, Plan, PlanOptions, Table};
use crate::transport::comm::Communicator;

/// What one rank tells the others about its build.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Record {
    /// 0 when the build succeeded, else the status code.
    status: u32,
    /// The failure's message, or the options as text (for the disagreement message).
    text: String,
    /// FNV-1a of every gathered table, in rank order: the same on every rank unless bytes changed.
    tables: u64,
    options: u64,
    /// The planner's fingerprint of everything it planned from (`Plan::inputs_fingerprint`).
    inputs: u64,
    version: u64,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(40 + self.text.len());
        out.extend_from_slice(&self.status.to_le_bytes());
        for v in [self.tables, self.options, self.inputs, self.version] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(self.text.as_bytes());
        out
    }

    fn decode(bytes: &[u8], rank: usize) -> Result<Record> {
        if bytes.len() < 36 {
            bail!(Status::DecodeError, "rank {rank}'s agreement record has {} bytes", bytes.len());
        }
        let word = |i: usize| u64::from_le_bytes(bytes[4 + 8 * i..12 + 8 * i].try_into().expect("8 bytes"));
        Ok(Record {
            status: u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
            tables: word(0),
            options: word(1),
            inputs: word(2),
            version: word(3),
            text: String::from_utf8_lossy(&bytes[36..]).into_owned(),
        })
    }
}

fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// This rank's share of the plan of every rank's table, `own` being this rank's, over `comm`: every
/// route from or to this rank's endpoints (the plan's process index is the communicator rank), or
/// an error on every rank (see the module docs). Blocks until every rank has called it, each step
/// bounded by the communicator's timeout.
///
/// Errors: those of the planner (a coverage gap or overlap in a rank's own needs on that rank, the
/// others ABORTED), DECODE_ERROR (a table's bytes changed on the way), INVALID_ARGUMENT (ranks
/// disagree; a table entry names another rank's process), ABORTED (another rank's build failed, or
/// a peer went away), TIMEOUT.
pub fn build_plan(comm: &Communicator, own: &Table, options: &PlanOptions) -> Result<Plan> {
    let tables = comm.allgather_bytes(&plan::wire::encode(own))?;
    let process = u32::try_from(comm.rank()).expect("communicator ranks fit in 32 bits");
    let built = tables
        .iter()
        .enumerate()
        .map(|(rank, bytes)| plan::wire::decode(bytes).map_err(|e| e.context(format!("rank {rank}'s table"))))
        .collect::<Result<Vec<Table>>>()
        .and_then(|tables| {
            own_entries_only(&tables)?;
            let borrowed: Vec<&Table> = tables.iter().collect();
            plan::build_share(&borrowed, process, options, &plan::Limits::default())
        });
    let options_text = format!("{options:?}");
    let mut record = Record {
        status: 0,
        text: options_text.clone(),
        tables: tables.iter().fold(FNV_START, |h, t| fnv(fnv(h, &(t.len() as u64).to_le_bytes()), t)),
        options: fnv(FNV_START, options_text.as_bytes()),
        inputs: built.as_ref().map_or(0, Plan::inputs_fingerprint),
        version: fnv(FNV_START, env!("CARGO_PKG_VERSION").as_bytes()),
    };
    if let Err(err) = &built {
        record.status = err.status as u32;
        record.text = err.message.clone();
    }
    let records = comm.allgather_bytes(&record.encode())?;
    let records =
        records.iter().enumerate().map(|(r, b)| Record::decode(b, r)).collect::<Result<Vec<Record>>>()?;
    let plan = built?;
    agree(&records, comm.rank())?;
    Ok(plan)
}

/// INVALID_ARGUMENT unless every table names only its own rank's process: a process offers and
/// receives its own memory, and an entry naming another would be planned as that process's. Every
/// rank checks every gathered table, so every rank fails alike.
fn own_entries_only(tables: &[Table]) -> Result<()> {
    for (rank, table) in tables.iter().enumerate() {
        let offers = table.offers.iter().map(|o| ("an offer", o.tensor, o.owner));
        let needs = table.needs.iter().map(|n| ("a need", n.tensor, n.receiver));
        if let Some((what, tensor, at)) = offers.chain(needs).find(|(_, _, at)| at.process as usize != rank) {
            let name = table.tensors.get(tensor as usize).map_or("?", |t| t.name.as_str());
            bail!(
                Status::InvalidArgument,
                "rank {rank}'s table has {what} of tensor '{name}' on process {} device {}: each rank's \
                 entries name its own process, its communicator rank",
                at.process,
                at.device
            );
        }
    }
    Ok(())
}

/// The same verdict on every rank: ABORTED naming the first rank whose build failed, else
/// INVALID_ARGUMENT naming the first rank that disagrees with rank 0.
fn agree(records: &[Record], rank: usize) -> Result<()> {
    if let Some((failed, record)) = records.iter().enumerate().find(|(_, r)| r.status != 0) {
        let status = Status::from_code(record.status.into())
            .map_or_else(|| format!("status {}", record.status), |s| s.name().to_string_lossy().into_owned());
        bail!(Status::Aborted, "rank {failed} could not build the plan ({status}: {})", record.text);
    }
    let first = &records[0];
    for (other, record) in records.iter().enumerate().skip(1) {
        let what = if record.version != first.version {
            "refit versions"
        } else if record.options != first.options {
            "plan options"
        } else if record.tables != first.tables {
            "gathered tables"
        } else if record.inputs != first.inputs {
            "planner inputs"
        } else {
            continue;
        };
        return Err(Error::invalid_argument(format!(
            "ranks 0 and {other} have different {what} (rank 0: {}, inputs {:#018x}; rank {other}: {}, \
             inputs {:#018x}): every rank must pass the same options; nothing was planned on rank {rank}",
            first.text, first.inputs, record.text, record.inputs
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(status: u32, options: u64, inputs: u64) -> Record {
        Record { status, text: format!("options {options}"), tables: 7, options, inputs, version: 1 }
    }

    #[test]
    fn records_round_trip_and_short_ones_are_refused() {
        let r = Record { text: "ünïcode".into(), ..record(17, 3, 4) };
        assert_eq!(Record::decode(&r.encode(), 0).unwrap(), r);
        assert_eq!(Record::decode(&[0; 35], 2).unwrap_err().status, Status::DecodeError);
    }

    #[test]
    fn every_rank_reaches_the_same_verdict() {
        assert!(agree(&[record(0, 1, 9), record(0, 1, 9)], 0).is_ok());
        let failed = [record(0, 1, 9), record(Status::CoverageGap as u32, 1, 0), record(21, 1, 0)];
        for rank in 0..3 {
            let err = agree(&failed, rank).unwrap_err();
            assert_eq!(err.status, Status::Aborted);
            assert!(
                err.message.contains("rank 1 could not build the plan (REFIT_STATUS_COVERAGE_GAP"),
                "{err}"
            );
        }
        let err = agree(&[record(0, 1, 9), record(0, 1, 9), record(0, 2, 8)], 1).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument);
        assert!(err.message.contains("ranks 0 and 2 have different plan options"), "{err}");
        let err = agree(&[record(0, 1, 9), record(0, 1, 8)], 0).unwrap_err();
        assert!(err.message.contains("different planner inputs"), "{err}");
    }
}
