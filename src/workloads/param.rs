//! The framework-neutral shape of a generated layout: parameters (one tensor as a framework allocates
//! it) made of pieces (one box of one Hugging Face tensor at a byte offset inside the parameter).

use crate::plan::{Endpoint, Region};

/// One box of a Hugging Face tensor stored row-major over its extent at `offset` bytes into a
/// parameter. Every piece a framework layout produces is contiguous: fused parameters are
/// concatenations of whole row blocks, and column splits are stored as their own row-major matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub tensor: u32,
    pub offset: u64,
    pub region: Region,
}

/// One framework parameter held by one endpoint: its name in that framework, its size in bytes, and
/// the tensor boxes it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Param {
    pub endpoint: Endpoint,
    pub name: String,
    pub bytes: u64,
    pub pieces: Vec<Piece>,
}

impl Param {
    pub(crate) fn new(endpoint: Endpoint, name: String, bytes: u64) -> Param {
        Param { endpoint, name, bytes, pieces: Vec::new() }
    }

    /// Adds a box of `tensor` at `offset`, rows `[row0, row0 + rows)` and columns `[col0, col0 + cols)`
    /// of a 2-D tensor.
    pub(crate) fn rows_cols(
        &mut self,
        tensor: u32,
        offset: u64,
        (row0, rows): (u64, u64),
        (col0, cols): (u64, u64),
    ) {
        self.pieces.push(Piece {
            tensor,
            offset,
            region: Region { offset: vec![row0, col0], extent: vec![rows, cols] },
        });
    }

    /// Adds a whole 1-D tensor of `len` elements at `offset`.
    pub(crate) fn vector(&mut self, tensor: u32, offset: u64, len: u64) {
        self.pieces.push(Piece { tensor, offset, region: Region { offset: vec![0], extent: vec![len] } });
    }
}

/// A replicated 1-D parameter (a norm, a bias) holding the whole tensor: `len` elements of `elem_size`.
pub(crate) fn replicated_vector(
    endpoint: Endpoint,
    name: String,
    tensor: u32,
    len: u64,
    elem_size: u64,
) -> Param {
    let mut p = Param::new(endpoint, name, len * elem_size);
    p.vector(tensor, 0, len);
    p
}

/// Rank `rank` of `ranks`' vocabulary-parallel shard of a `[vocab, hidden]` tensor (embedding or
/// output layer): every shard is sized `ceil(vocab / ranks)` rows, the last one holding fewer (or none).
pub(crate) fn vocab_rows(
    endpoint: Endpoint,
    name: String,
    tensor: u32,
    (vocab, hidden): (u64, u64),
    (rank, ranks): (u64, u64),
    elem_size: u64,
) -> Param {
    let (start, rows, chunk) = ceil_chunk(vocab, ranks, rank);
    let mut p = Param::new(endpoint, name, chunk * hidden * elem_size);
    if rows > 0 {
        p.rows_cols(tensor, 0, (start, rows), (0, hidden));
    }
    p
}

/// The `i`-th of `parts` chunks of `total` rows when every chunk but the last is `ceil(total/parts)`
/// (how both frameworks split a padded vocabulary): `(start, len, chunk)`, `len` possibly 0.
pub(crate) fn ceil_chunk(total: u64, parts: u64, i: u64) -> (u64, u64, u64) {
    let chunk = total.div_ceil(parts);
    let start = (i * chunk).min(total);
    let end = ((i + 1) * chunk).min(total);
    (start, end - start, chunk)
}
