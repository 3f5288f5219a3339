//! The framework-neutral shape of a generated layout: parameters (one tensor as a framework allocates
//! it) made of pieces (one box of one Hugging Face tensor at a byte offset inside the parameter).

use crate::arch::Arch;
use refit::plan::{Endpoint, Region};

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

    /// Adds rows `rows` of `gate`, then the same rows of `up`, from byte `offset`: one fused
    /// `[gate | up]` block of a gated MLP whose rows are `hidden` elements of `elem_size` bytes.
    pub(crate) fn gate_up_rows(
        &mut self,
        [gate, up]: [u32; 2],
        offset: u64,
        rows: (u64, u64),
        (hidden, elem_size): (u64, u64),
    ) {
        self.rows_cols(gate, offset, rows, (0, hidden));
        self.rows_cols(up, offset + rows.1 * hidden * elem_size, rows, (0, hidden));
    }

    /// Adds a whole 1-D tensor of `len` elements at `offset`.
    pub(crate) fn vector(&mut self, tensor: u32, offset: u64, len: u64) {
        self.pieces.push(Piece { tensor, offset, region: Region { offset: vec![0], extent: vec![len] } });
    }
}

/// Makes the parameters one endpoint holds as rank `tp` of `tp_size` tensor-parallel ranks of a
/// model: sizes in elements of the model's element size.
pub(crate) struct RankParams {
    pub endpoint: Endpoint,
    pub tp: u64,
    pub tp_size: u64,
    /// Bytes per element.
    pub es: u64,
    pub hidden: u64,
    pub vocab: u64,
    /// Rows of this framework's vocabulary-parallel shard: the padded vocabulary over `tp_size`.
    pub vocab_rows: u64,
}

impl RankParams {
    pub(crate) fn new(
        endpoint: Endpoint,
        (tp, tp_size): (u64, u64),
        arch: &Arch,
        vocab_rows: u64,
    ) -> RankParams {
        RankParams {
            endpoint,
            tp,
            tp_size,
            es: arch.elem_size as u64,
            hidden: arch.hidden,
            vocab: arch.vocab,
            vocab_rows,
        }
    }

    /// An empty parameter of `elems` elements.
    pub(crate) fn param(&self, name: String, elems: u64) -> Param {
        Param::new(self.endpoint, name, elems * self.es)
    }

    /// A replicated 1-D parameter (a norm, a bias) holding the whole tensor of `len` elements.
    pub(crate) fn vector(&self, name: String, tensor: u32, len: u64) -> Param {
        self.vector_of(name, tensor, len, self.es)
    }

    /// [`RankParams::vector`] of elements of `elem_size` bytes (an FP32 tensor in a BF16 model).
    pub(crate) fn vector_of(&self, name: String, tensor: u32, len: u64, elem_size: u64) -> Param {
        let mut p = Param::new(self.endpoint, name, len * elem_size);
        p.vector(tensor, 0, len);
        p
    }

    /// A replicated 2-D parameter holding the whole `[rows, cols]` tensor.
    pub(crate) fn whole(&self, name: String, tensor: u32, (rows, cols): (u64, u64)) -> Param {
        let mut p = self.param(name, rows * cols);
        p.rows_cols(tensor, 0, (0, rows), (0, cols));
        p
    }

    /// This rank's vocabulary-parallel shard of a `[vocab, hidden]` tensor (embedding or output
    /// layer): `vocab_rows` rows from row `tp * vocab_rows`, of which those past the vocabulary are
    /// padding (a shard may be all padding).
    pub(crate) fn vocab_shard(&self, name: &str, tensor: u32) -> Param {
        let start = (self.tp * self.vocab_rows).min(self.vocab);
        let rows = ((self.tp + 1) * self.vocab_rows).min(self.vocab) - start;
        let mut p = self.param(name.to_string(), self.vocab_rows * self.hidden);
        if rows > 0 {
            p.rows_cols(tensor, 0, (start, rows), (0, self.hidden));
        }
        p
    }

    /// Rows `[tp * rows, (tp + 1) * rows)`: this rank's block of a column-parallel split.
    pub(crate) fn tp_rows(&self, rows: u64) -> (u64, u64) {
        (self.tp * rows, rows)
    }
}
