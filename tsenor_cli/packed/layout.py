"""One matrix's packed form: a pruned (rows, cols) weight encoded as kept values and a code, decoded bit for bit.

Layout (docs/reference/packed-format.md is the reference): an N:M matrix keeps exactly N positions per
group of M consecutive inputs of each row (nonzeros first, then the lowest-numbered zeros); its values are
a (rows, cols/M, N) tensor in the weight's own dtype, in ascending column order. The code is either a
bit mask (one bit per weight) or the kept positions' indices inside their group (ceil(log2 M) bits
each), whichever is smaller for the pattern, ties going to the indices (2:4's are the hardware's sparse
metadata). Bits are packed least significant first, each row padded to whole bytes. An unstructured
matrix keeps every entry whose bits are not all zero: its values are 1-D in row-major order, its code a
bit mask. Positions not kept decode to +0.0: the prune writes pruned weights as +0.0, so the decoded
matrix is the dense output bit for bit.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import cache
from typing import Any, Literal

import torch

from tsenor_cli.errors import PackedFormatError

Encoding = Literal["mask", "index"]
MASK_SUFFIX = "_tsenor_mask"
INDEX_SUFFIX = "_tsenor_index"
SUFFIXES: dict[str, Encoding] = {MASK_SUFFIX: "mask", INDEX_SUFFIX: "index"}
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def index_bits(m: int) -> int:
    """Bits of one kept position's index inside a group of `m`."""
    return max(1, math.ceil(math.log2(m)))


def code_bits(kind: str, n: int, m: int) -> dict[Encoding, int]:
    """Bits per group of `m` weights of each encoding of an N:M pattern (the mask alone for unstructured)."""
    if kind == "unstructured":
        return {"mask": m}
    return {"mask": m, "index": n * index_bits(m)}


def choose_encoding(kind: str, n: int, m: int) -> Encoding:
    """The smaller code for the pattern; a tie goes to the indices."""
    sizes = code_bits(kind, n, m)
    return "index" if "index" in sizes and sizes["index"] <= sizes["mask"] else "mask"


@dataclass(frozen=True)
class MatrixPattern:
    """What the file records of one packed matrix: kind (transposable, nm or unstructured), n and m (0 for
    unstructured), its (rows, cols) shape as pruned, and its code's encoding; experts: 0 for one matrix,
    else the number E of (rows, cols) matrices stacked in one 3-D parameter; transposed: the parameter
    stores each matrix as (cols, rows) (GPT-2's Conv1D), the pattern being the matrix's as pruned."""

    kind: str
    n: int
    m: int
    rows: int
    cols: int
    encoding: Encoding
    experts: int = 0
    transposed: bool = False

    @classmethod
    def of(
        cls, kind: str, n: int, m: int, shape: tuple[int, ...], *, experts: int = 0, transposed: bool = False
    ) -> MatrixPattern:
        """The record of a (rows, cols) matrix as pruned (`experts` of them stacked, each stored transposed)."""
        if len(shape) != 2:
            raise PackedFormatError(f"a packed matrix must be 2-D, got shape {tuple(shape)}")
        rows, cols = shape
        if kind == "unstructured":
            return cls(kind, 0, 0, rows, cols, "mask", experts, transposed)
        return cls(kind, n, m, rows, cols, choose_encoding(kind, n, m), experts, transposed)

    def flat(self) -> MatrixPattern:
        """The one (E·rows, cols) matrix the stack's matrices are encoded as, rows after rows (a tile of M rows
        never spans two experts, rows being a multiple of M for transposable)."""
        return replace(self, rows=self.rows * max(self.experts, 1), experts=0, transposed=False)

    def fitted(self, shape: tuple[int, ...]) -> MatrixPattern:
        """This record for a parameter of `shape`: a stack of experts kept in one 2-D parameter (DBRX's
        (E·rows, cols), viewed per expert) is one matrix of E·rows rows; PackedFormatError for another shape."""
        if tuple(shape) == self.stored_shape():
            return self
        flat = replace(self.flat(), transposed=self.transposed)
        if self.experts and tuple(shape) == flat.stored_shape():
            return flat
        raise PackedFormatError(f"a {tuple(shape)} weight does not have its record's shape {self.stored_shape()}")

    def stored_shape(self) -> tuple[int, ...]:
        """The parameter's dense shape, as the checkpoint stores it."""
        matrix = (self.cols, self.rows) if self.transposed else (self.rows, self.cols)
        return (self.experts, *matrix) if self.experts else matrix

    @property
    def suffix(self) -> str:
        return MASK_SUFFIX if self.encoding == "mask" else INDEX_SUFFIX

    @property
    def label(self) -> str:
        if self.kind == "unstructured":
            return "unstructured"
        return f"{self.n}:{self.m}" + (" transposable" if self.kind == "transposable" else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, where: str) -> MatrixPattern:
        """The record of a matrix in a file's metadata; PackedFormatError when it is not one."""
        try:
            made = cls(**data)
            ok = made.kind in ("transposable", "nm", "unstructured") and made.encoding in ("mask", "index")
            ok = ok and made.rows > 0 and made.cols > 0 and isinstance(made.experts, int) and made.experts >= 0
            ok = ok and isinstance(made.transposed, bool)
            if made.kind != "unstructured":
                ok = ok and 1 <= made.n < made.m and made.cols % made.m == 0
                ok = ok and made.encoding == choose_encoding(made.kind, made.n, made.m)
                ok = ok and (made.kind != "transposable" or made.rows % made.m == 0)
        except TypeError:
            ok = False
        if not ok:
            raise PackedFormatError(f"{where}: {json.dumps(data)} is not a packed matrix's pattern record")
        return made

    def code_shape(self) -> tuple[int, ...]:
        """(rows, B), or (E, rows, B) for a stack: each matrix row's code."""
        if self.encoding == "mask":
            per_row = math.ceil(self.cols / 8)
        else:
            per_row = math.ceil(self.cols // self.m * self.n * index_bits(self.m) / 8)
        return (self.experts, self.rows, per_row) if self.experts else (self.rows, per_row)

    def stored_nbytes(self, itemsize: int, kept: int | None = None) -> int:
        """Bytes the matrix takes packed: its values (`itemsize` bytes each; `kept` of them for unstructured,
        whose count the pattern does not fix) and its code."""
        shape = self.values_shape()
        if shape is None and kept is None:
            raise ValueError("an unstructured matrix's packed size needs its kept count")
        values = math.prod(shape) if shape is not None else int(kept or 0)
        return values * itemsize + math.prod(self.code_shape())

    def values_shape(self) -> tuple[int, ...] | None:
        """The values' shape; None for unstructured (its length is the matrix's kept count)."""
        if self.kind == "unstructured":
            return None
        shape = (self.rows, self.cols // self.m, self.n)
        return (self.experts, *shape) if self.experts else shape


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """(rows, L) bool → (rows, ceil(L/8)) uint8: element j of a row is bit j % 8 of byte j // 8."""
    rows, length = bits.shape
    padded = torch.nn.functional.pad(bits.to(torch.uint8), (0, -length % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (padded.view(rows, -1, 8) << shifts).sum(-1, dtype=torch.uint8)


def _check_padding(code: torch.Tensor, length: int) -> None:
    """PackedFormatError when a (rows, B) code sets any bit past the first `length` of a row."""
    whole, spare = divmod(length, 8)
    tail = code[:, whole + (spare > 0) :]
    if (spare and bool((code[:, whole] >> spare).any())) or bool(tail.any()):
        raise PackedFormatError("a packed code sets padding bits past the end of its row")


@cache
def _field_table(width: int) -> torch.Tensor:
    """(256, 8 // width) uint8: the `width`-bit fields of each byte value, least significant first (a
    lookup turns a code into its fields in one gather instead of a shift and a mask per bit)."""
    shifts = torch.arange(0, 8, width, dtype=torch.int32)
    return ((torch.arange(256, dtype=torch.int32)[:, None] >> shifts) & ((1 << width) - 1)).to(torch.uint8)


def _fields(code: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The first `count` `width`-bit fields of each row of a (rows, B) uint8 code, width dividing 8."""
    rows = code.shape[0]
    table = _field_table(width).to(code.device)
    return table.index_select(0, code.reshape(-1).to(torch.int32)).view(rows, -1)[:, :count]


def unpack_bits(code: torch.Tensor, length: int) -> torch.Tensor:
    """`pack_bits`'s inverse: (rows, B) uint8 → (rows, length) bool; the padding bits must be zero."""
    _check_padding(code, length)
    return _fields(code, 1, length).contiguous().view(torch.bool)


def _raw(weight: torch.Tensor) -> torch.Tensor:
    """The weight's bits as integers of the same width: -0.0 is nonzero there."""
    return weight.view(_INT_VIEW[weight.element_size()])


def _kept_positions(groups: torch.Tensor, n: int) -> torch.Tensor:
    """(rows, G, n) ascending positions kept in each group of (rows, G, M): nonzero values first, then
    the entries whose bits are nonzero (-0.0), then the lowest-numbered zeros."""
    m = groups.shape[-1]
    rank = (groups != 0).to(torch.int32) * 2 + (_raw(groups) != 0).to(torch.int32)
    order = torch.arange(m - 1, -1, -1, dtype=torch.int32, device=groups.device)
    return (rank * m + order).topk(n, dim=-1).indices.sort(dim=-1).values


def _complete_tile(tile: torch.Tensor, n: int) -> torch.Tensor:
    """An (m, m) bool tile keeping at most n per row and per column, completed with positions it does not
    keep to exactly n per row and per column: a bipartite b-matching of the rows' and the columns' deficits
    over the free positions, by augmenting paths (rows and columns in ascending order, so the result is
    deterministic). PackedFormatError when no completion exists."""
    m = tile.shape[0]
    added = [[False] * m for _ in range(m)]
    free = (~tile).tolist()
    col_need = [n - int(c) for c in tile.sum(0)]

    def augment(row: int, seen: list[bool]) -> bool:
        # A free position of `row` to a column that still needs one, or one whose added position can move.
        for col in range(m):
            if not free[row][col] or added[row][col] or seen[col]:
                continue
            seen[col] = True
            if col_need[col] > 0:
                col_need[col] -= 1
                added[row][col] = True
                return True
            for other in range(m):
                if added[other][col] and augment(other, seen):
                    added[row][col], added[other][col] = True, False
                    return True
        return False

    for row, count in enumerate(tile.sum(1).tolist()):
        for _ in range(n - int(count)):
            if not augment(row, [False] * m):
                raise PackedFormatError(f"its kept entries cannot be completed to a transposable {n}:{m} tile")
    return tile | torch.tensor(added, dtype=torch.bool)


def transposable_mask(weight: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The (rows, cols) kept positions of a transposable N:M weight: its entries whose bits are nonzero, and,
    in a tile keeping fewer than N in some row (weights that were zero before pruning), free positions that
    complete it to exactly N per row and per column (`_complete_tile`). PackedFormatError when a tile's
    row or column holds more than N nonzeros."""
    rows, cols = weight.shape
    kept = _raw(weight) != 0
    tiles = kept.view(rows // m, m, cols // m, m).transpose(1, 2)  # (TR, TC, m, m)
    if bool((tiles.sum(-1) > n).any()) or bool((tiles.sum(-2) > n).any()):
        raise PackedFormatError(f"a {rows}×{cols} weight keeps more than {n} of {m} in some tile row or column")
    short = (tiles.sum(-1) < n).any(-1).nonzero().tolist()
    if not short:
        return kept
    tiles = tiles.clone()
    for tile_row, tile_col in short:  # only tiles with zero weights among the kept: rare, each small
        tiles[tile_row, tile_col] = _complete_tile(tiles[tile_row, tile_col], n)
    return tiles.transpose(1, 2).reshape(rows, cols)


def _encode_matrix(weight: torch.Tensor, pattern: MatrixPattern) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, code) of a 2-D `weight` under the 2-D `pattern`; PackedFormatError when a group holds more than N
    nonzeros. The zeros' sign bits at positions not kept are not stored (they decode as +0.0)."""
    if tuple(weight.shape) != (pattern.rows, pattern.cols):
        raise PackedFormatError(f"a {tuple(weight.shape)} weight does not have its record's shape")
    if pattern.kind == "unstructured":
        kept = _raw(weight) != 0
        return weight[kept], pack_bits(kept)
    rows, n, m = pattern.rows, pattern.n, pattern.m
    groups = weight.reshape(rows, -1, m)
    if int((groups != 0).sum(-1).max()) > n:
        raise PackedFormatError(f"a {rows}×{pattern.cols} weight keeps more than {n} of {m} in some group")
    if pattern.kind == "transposable":
        # The kept positions must also keep N per tile column: zeros are not filled in row by row.
        positions = _kept_positions(transposable_mask(weight, n, m).view(rows, -1, m).to(weight.dtype), n)
    else:
        positions = _kept_positions(groups, n)
    values = groups.gather(-1, positions)
    if pattern.encoding == "index":
        shifts = torch.arange(index_bits(m), dtype=torch.int64, device=weight.device)
        bits = ((positions.unsqueeze(-1) >> shifts) & 1).reshape(rows, -1).bool()
        return values, pack_bits(bits)
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, positions, True)
    return values, pack_bits(mask.view(rows, -1))


@cache
def _group_tables(n: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For an index code whose groups fit in a byte (N·b dividing 8): the (2^(N·b), M) bool mask and the
    (2^(N·b),) validity (indices strictly ascending and below M) of every value a group's bits can take,
    so a group decodes and checks in one lookup instead of a field split, a scatter and a comparison."""
    b = index_bits(m)
    codes = torch.arange(1 << (n * b), dtype=torch.int64)
    positions = (codes[:, None] >> (torch.arange(n) * b)) & ((1 << b) - 1)
    valid = (positions < m).all(-1) & (positions.diff(dim=-1) > 0).all(-1)
    mask = torch.zeros(len(codes), m, dtype=torch.bool).scatter_(-1, positions.clamp(max=m - 1), True)
    return mask, valid


def _byte_group_mask(code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The checked (rows, cols) mask of an index code whose groups fit in a byte (`_group_tables`)."""
    rows, n, m = pattern.rows, pattern.n, pattern.m
    width, groups = n * index_bits(m), pattern.cols // m
    _check_padding(code, groups * width)
    per_group = _fields(code, width, groups).reshape(-1).to(torch.int32)
    mask_table, valid_table = (table.to(code.device) for table in _group_tables(n, m))
    if not bool(valid_table.index_select(0, per_group).all()):
        raise PackedFormatError(f"its indices break {pattern.label}: a position not ascending in its group or past M")
    return mask_table.index_select(0, per_group).view(rows, pattern.cols)


def _index_dtype(bits: int) -> torch.dtype:
    """The smallest integer dtype holding a `bits`-bit index (shifts stay below its sign bit)."""
    return torch.uint8 if bits <= 8 else torch.int16 if bits < 16 else torch.int32


def _positions(code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """(rows, G, n) kept positions of an index code, as stored (unchecked), in the smallest integer dtype."""
    rows, n, m = pattern.rows, pattern.n, pattern.m
    b, groups = index_bits(m), pattern.cols // m
    _check_padding(code, groups * n * b)
    if 8 % b == 0:
        return _fields(code, b, groups * n).reshape(rows, groups, n)
    dtype = _index_dtype(b)
    bits = _fields(code, 1, groups * n * b).reshape(rows, groups, n, b).to(dtype)
    return (bits << torch.arange(b, dtype=dtype, device=code.device)).sum(-1, dtype=dtype)


def _check_code(code: torch.Tensor, pattern: MatrixPattern) -> None:
    """PackedFormatError when the code's shape or dtype is not the record's."""
    if tuple(code.shape) != pattern.code_shape() or code.dtype != torch.uint8:
        raise PackedFormatError(f"its code is {tuple(code.shape)} {code.dtype}, not {pattern.code_shape()} uint8")


def _index_mask(positions: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The (rows, cols) bool mask of (rows, G, n) positions; PackedFormatError for a position past M."""
    if (1 << index_bits(pattern.m)) > pattern.m and int(positions.max()) >= pattern.m:
        raise PackedFormatError(f"its indices break {pattern.label}: a position past M")
    grouped = torch.zeros(pattern.rows, pattern.cols // pattern.m, pattern.m, dtype=torch.bool, device=positions.device)
    return grouped.scatter_(-1, positions.long(), True).view(pattern.rows, pattern.cols)


def _stored_matrix_mask(code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The (rows, cols) bool mask of the positions the code marks, without checking it against the pattern
    (`tsenor verify` counts its tiles itself); PackedFormatError when the code's shape, dtype, padding or
    an index past M cannot describe the matrix at all."""
    _check_code(code, pattern)
    if pattern.encoding == "mask":
        return unpack_bits(code, pattern.cols)
    return _index_mask(_positions(code, pattern), pattern)


def _count_dtype(m: int) -> torch.dtype:
    """The dtype counting up to `m` kept entries: a byte wide when it fits (a quarter of int32's traffic)."""
    return torch.uint8 if m < 256 else torch.int32


def _kept_matrix_mask(code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The (rows, cols) bool mask of kept positions, checked against the pattern (N per group, and per
    column of each M×M tile for transposable; indices strictly ascending); PackedFormatError when it breaks it.
    Each check is one vectorized pass: indices strictly ascending and below M already keep exactly N per
    group, so only a mask code has its groups counted."""
    if pattern.kind == "unstructured":
        return _stored_matrix_mask(code, pattern)
    _check_code(code, pattern)
    rows, cols, n, m = pattern.rows, pattern.cols, pattern.n, pattern.m
    if pattern.encoding == "index" and 8 % (n * index_bits(m)) == 0:
        mask = _byte_group_mask(code, pattern)
    elif pattern.encoding == "index":
        positions = _positions(code, pattern)
        if n > 1 and bool((positions[..., 1:] <= positions[..., :-1]).any()):
            raise PackedFormatError(f"its indices break {pattern.label}: a position not ascending in its group")
        mask = _index_mask(positions, pattern)
    else:
        mask = unpack_bits(code, cols)
        counts = mask.view(torch.uint8).view(rows, -1, m).sum(-1, dtype=_count_dtype(m))
        if bool((counts != n).any()):
            raise PackedFormatError(f"its mask breaks {pattern.label}: a group does not keep exactly {n} of {m}")
    if pattern.kind == "transposable":
        per_column = mask.view(torch.uint8).view(rows // m, m, cols).sum(1, dtype=_count_dtype(m))
        if bool((per_column != n).any()):
            raise PackedFormatError(f"its mask breaks {pattern.label}: a tile's column does not keep {n} of {m}")
    return mask


# Elements of a matrix per intra-op thread while decoding: below this a pass over the matrix costs less
# than the threads' synchronization, which grows tenfold when other work shares the cores.
_ELEMENTS_PER_THREAD = 1 << 22


@contextmanager
def _decode_threads(elements: int) -> Iterator[None]:
    """At most one intra-op thread per `_ELEMENTS_PER_THREAD` elements inside the block, restored after."""
    before = torch.get_num_threads()
    wanted = max(1, min(before, elements // _ELEMENTS_PER_THREAD))
    if wanted == before:
        yield
        return
    torch.set_num_threads(wanted)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _decode_matrix(values: torch.Tensor, code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The dense (rows, cols) weight of a 2-D `pattern` in the values' dtype; PackedFormatError when the code breaks the
    pattern or does not fit the values."""
    expected = pattern.values_shape()
    if expected is not None and tuple(values.shape) != expected:
        raise PackedFormatError(f"its values are {tuple(values.shape)}, not {expected}")
    with _decode_threads(pattern.rows * pattern.cols):
        # The result is allocated before the mask and its temporaries: above it, they free to the top of the
        # heap when the decoding ends, instead of into a hole under it that a loaded model keeps resident.
        dense = torch.zeros(pattern.rows, pattern.cols, dtype=values.dtype, device=values.device)
        mask = _kept_matrix_mask(code, pattern)
        if expected is None and (values.dim() != 1 or values.numel() != int(mask.sum())):
            raise PackedFormatError(f"its {values.numel()} values do not match the {int(mask.sum())} kept positions")
        # masked_scatter fills the kept positions in row-major order: the values' own order.
        return dense.masked_scatter_(mask, values.reshape(-1))


def _as_flat(tensor: torch.Tensor, shape: tuple[int, ...] | None) -> torch.Tensor:
    return tensor.reshape(shape) if shape is not None else tensor


def encode(weight: torch.Tensor, pattern: MatrixPattern) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, code) of a parameter stored as `pattern.stored_shape()`: each matrix as pruned (transposed
    back from a Conv1D's layout), a stack's matrices one after the other; PackedFormatError when a group
    holds more than N nonzeros or the shape is not the record's."""
    if tuple(weight.shape) != pattern.stored_shape():
        raise PackedFormatError(f"a {tuple(weight.shape)} weight does not have its record's shape")
    flat = pattern.flat()
    matrix = weight.transpose(-1, -2) if pattern.transposed else weight
    values, code = _encode_matrix(matrix.reshape(flat.rows, flat.cols), flat)
    return _as_flat(values, pattern.values_shape()), code.reshape(pattern.code_shape())


def decode(values: torch.Tensor, code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The dense parameter (`pattern.stored_shape()`) in the values' dtype; PackedFormatError when the code
    breaks the pattern or does not fit the values."""
    expected = pattern.values_shape()
    if expected is not None and tuple(values.shape) != expected:
        raise PackedFormatError(f"its values are {tuple(values.shape)}, not {expected}")
    _check_code(code, pattern)
    flat = pattern.flat()
    dense = _decode_matrix(_as_flat(values, flat.values_shape()), code.reshape(flat.code_shape()), flat)
    if pattern.experts:
        dense = dense.view(pattern.experts, pattern.rows, pattern.cols)
    return dense.transpose(-1, -2).contiguous() if pattern.transposed else dense


def stored_mask(code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """The bool mask of the positions the code marks, each matrix as pruned ((rows, cols), or (E, rows, cols)
    for a stack), not checked against the pattern (`tsenor verify` counts its tiles itself);
    PackedFormatError when the code's shape, dtype, padding or an index past M cannot describe it at all."""
    _check_code(code, pattern)
    flat = pattern.flat()
    mask = _stored_matrix_mask(code.reshape(flat.code_shape()), flat)
    return mask.view(pattern.experts, pattern.rows, pattern.cols) if pattern.experts else mask


def kept_mask(code: torch.Tensor, pattern: MatrixPattern) -> torch.Tensor:
    """`stored_mask`, checked against the pattern (N per group, and per column of each M×M tile for
    transposable; indices strictly ascending); PackedFormatError when it breaks it."""
    _check_code(code, pattern)
    flat = pattern.flat()
    mask = _kept_matrix_mask(code.reshape(flat.code_shape()), flat)
    return mask.view(pattern.experts, pattern.rows, pattern.cols) if pattern.experts else mask
