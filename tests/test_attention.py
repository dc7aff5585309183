"""Paged attention against a naive reference, for every way of reading the cache."""

from __future__ import annotations

import random

import pytest
import torch

from slotserve.kernels import decode_attention, native
from slotserve.kernels.decode_attention import PagedTables
from slotserve.kv_cache.block_table import cache_index, cache_indices
from slotserve.layers.attention import Attention, AttentionMetadata, GatherWorkspace

BS, H, KV, D = 4, 4, 2, 8
NEEDS_KERNEL = pytest.mark.skipif(not decode_attention.available(), reason="no C compiler with OpenMP here")
PAGED = pytest.param("paged", marks=NEEDS_KERNEL)


def _reference(q, keys, values, start):
    """Softmax attention of queries at positions start.. over keys, one sequence, GQA by repetition."""
    k = keys.repeat_interleave(H // KV, dim=1)
    v = values.repeat_interleave(H // KV, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * D**-0.5
    positions = torch.arange(q.shape[0])[:, None] + start
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("mode", [PAGED, "batched", "per_seq"])
@pytest.mark.parametrize("layout", ["consecutive", "scattered"])
@pytest.mark.parametrize("gather_limit", [0, 1000])  # 1000: consecutive decode rows join the batched gather
def test_mixed_batch_matches_reference(mode, layout, gather_limit):
    rng = random.Random(1)
    torch.manual_seed(0)
    query_lens, seq_lens = [1, 5, 1, 1, 3], [9, 5, 14, 3, 11]  # decodes, a prefill and a chunk after a prefix
    need = [-(-n // BS) for n in seq_lens]
    ids = list(range(sum(need) + 3))
    if layout == "scattered":
        rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    attn = Attention(H, KV, D, D**-0.5)
    attn.k_cache = torch.randn(len(ids) * BS, KV, D)
    attn.v_cache = torch.randn(len(ids) * BS, KV, D)
    total = sum(query_lens)
    q, k, v = torch.randn(total, H, D), torch.randn(total, KV, D), torch.randn(total, KV, D)
    indices = [i for t, n, ql in zip(tables, seq_lens, query_lens, strict=True)
               for i in cache_indices(t, n - ql, n, BS)]
    meta = AttentionMetadata.build(query_lens, seq_lens, torch.tensor(indices), tables, BS, decode_mode=mode,
                                   workspace=GatherWorkspace(), gather_limit=gather_limit)
    joined = [c is None for c, ql in zip(meta.context, query_lens, strict=True) if ql == 1]
    if mode == "per_seq":
        assert not any(joined)
    elif gather_limit or mode == "paged":
        assert all(joined)
    assert isinstance(meta.decode, PagedTables) == (mode == "paged")
    out = attn(q, k, v, meta)
    row = 0
    for table, n, ql in zip(tables, seq_lens, query_lens, strict=True):
        ctx = [table[p // BS] * BS + p % BS for p in range(n)]
        expected = _reference(q[row:row + ql], attn.k_cache[ctx], attn.v_cache[ctx], n - ql)
        assert torch.allclose(out[row:row + ql], expected, atol=1e-5), (table, n, ql)
        row += ql


def test_unknown_decode_mode_is_rejected():
    with pytest.raises(ValueError, match="decode_mode"):
        AttentionMetadata.build([1], [1], torch.tensor([0]), [[0]], BS, decode_mode="magic")


@pytest.mark.parametrize("mode", ["per_seq", PAGED])
def test_a_sequence_reads_the_same_bits_in_place_or_gathered(mode):
    """per_seq mode gives a sequence the same SDPA call whatever its blocks' layout or its company, so
    its output is bitwise the same (what keeps int8's greedy output the same alone and batched); the paged
    kernel visits the keys in position order whatever blocks hold them."""
    torch.manual_seed(0)
    lengths = [13, 7, 10]
    num_blocks = 16
    attn = Attention(H, KV, D, D**-0.5)
    attn.k_cache = torch.zeros(num_blocks * BS, KV, D)
    attn.v_cache = torch.zeros(num_blocks * BS, KV, D)
    history = [(torch.randn(n, KV, D), torch.randn(n, KV, D)) for n in lengths]
    q = torch.randn(len(lengths), H, D)

    def decode(tables: list[list[int]], seqs: list[int]) -> torch.Tensor:
        for i in seqs:  # write each history into its blocks
            indices = cache_indices(tables[i], 0, lengths[i], BS)
            attn.k_cache[indices], attn.v_cache[indices] = history[i]
        new = [cache_index(tables[i], lengths[i] - 1, BS) for i in seqs]
        meta = AttentionMetadata.build([1] * len(seqs), [lengths[i] for i in seqs], torch.tensor(new),
                                       [tables[i] for i in seqs], BS, decode_mode=mode)
        k = torch.stack([history[i][0][-1] for i in seqs])
        v = torch.stack([history[i][1][-1] for i in seqs])
        return attn(q[seqs], k, v, meta)

    consecutive = [[0, 1, 2, 3], [4, 5], [6, 7, 8]]
    scattered = [[9, 2, 14, 5], [11, 0], [3, 15, 7]]
    alone = torch.cat([decode(consecutive, [i]) for i in range(len(lengths))])
    assert torch.equal(decode(scattered, [0, 1, 2]), alone)
    assert torch.equal(decode(consecutive, [0, 1, 2]), alone)


@pytest.mark.parametrize("mode, gather_limit", [("batched", 0), ("batched", 1000), ("per_seq", 0),
                                               pytest.param("paged", 0, marks=NEEDS_KERNEL)])
def test_decode_rows_get_the_same_bits_alone_or_batched(mode, gather_limit):
    """Real head sizes and lengths far apart: in a padded batch a short sequence meets many more keys
    than alone, and the kernel's result for a row changes with the key count unless it is aligned."""
    torch.manual_seed(0)
    heads, kv_heads, dim, bs = 14, 2, 64, 16
    lengths = [37, 100, 250, 3]
    attn = Attention(heads, kv_heads, dim, dim**-0.5)
    need = [-(-n // bs) for n in lengths]
    attn.k_cache = torch.randn(sum(need) * bs, kv_heads, dim)
    attn.v_cache = torch.randn(sum(need) * bs, kv_heads, dim)
    ids = list(range(sum(need)))
    if gather_limit == 0:
        random.Random(0).shuffle(ids)  # else consecutive: alone they are read in place, together gathered
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lengths))]
    q = torch.randn(len(lengths), heads, dim)
    k, v = torch.randn(len(lengths), kv_heads, dim), torch.randn(len(lengths), kv_heads, dim)

    def decode(seqs: list[int]) -> torch.Tensor:
        new = torch.tensor([cache_index(tables[i], lengths[i] - 1, bs) for i in seqs])
        meta = AttentionMetadata.build([1] * len(seqs), [lengths[i] for i in seqs], new,
                                       [tables[i] for i in seqs], bs, decode_mode=mode, gather_limit=gather_limit)
        return attn(q[seqs], k[seqs], v[seqs], meta)

    alone = torch.cat([decode([i]) for i in range(len(lengths))])
    assert torch.equal(decode(list(range(len(lengths)))), alone)


def _avx2_attention():
    """decode_attention through the kernel's build without AVX-512 (8 lanes: what a laptop runs), or a skip."""
    attend = native.function(decode_attention.SOURCE, "slotserve_decode_attention", decode_attention._ARGS,
                             ("-mno-avx512f",))
    if attend is None:
        pytest.skip("no AVX2 build here")

    def run(q, out, k_cache, v_cache, tables, block_size, scale):
        assert attend(q.data_ptr(), out.data_ptr(), tables.rows.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                      tables.block_tables.data_ptr(), tables.block_tables.shape[1], tables.lens.data_ptr(),
                      tables.rows.shape[0], q.shape[1], k_cache.shape[1], q.shape[2], block_size, scale,
                      torch.get_num_threads()) == 0
    return run


@NEEDS_KERNEL
@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(14, 2, 64), (8, 8, 128), (6, 2, 24), (1, 1, 1)])
def test_paged_kernel_matches_reference_for_many_shapes(build, heads, kv_heads, dim):
    """Head sizes with and without a vector tail, no GQA and deep GQA, lengths around the vector width (the
    scores of whole runs of vector-width keys go together), in both vector widths."""
    attend = decode_attention.decode_attention if build == "native" else _avx2_attention()
    torch.manual_seed(0)
    bs, lengths = 16, [1, 2, 15, 16, 17, 31, 33, 200]
    need = [-(-n // bs) for n in lengths]
    ids = list(range(sum(need)))
    random.Random(2).shuffle(ids)
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lengths))]
    k_cache, v_cache = torch.randn(len(ids) * bs, kv_heads, dim), torch.randn(len(ids) * bs, kv_heads, dim)
    q = torch.randn(len(lengths) + 1, heads, dim)  # a spare row the kernel must leave alone
    out = torch.full_like(q, 7.0)
    width = max(need)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    rows = torch.arange(1, len(lengths) + 1)
    paged = PagedTables.build(rows, padded, torch.tensor(lengths, dtype=torch.int32), bs)
    attend(q, out, k_cache, v_cache, paged, bs, dim**-0.5)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    for row, table, n in zip(rows.tolist(), tables, lengths, strict=True):
        ctx = [table[p // bs] * bs + p % bs for p in range(n)]
        k = k_cache[ctx].repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[ctx].repeat_interleave(heads // kv_heads, dim=1)
        expected = torch.einsum("hk,khd->hd", torch.einsum("hd,khd->hk", q[row], k).mul(dim**-0.5).softmax(-1), v)
        torch.testing.assert_close(out[row], expected, rtol=1e-5, atol=1e-5)


@NEEDS_KERNEL
def test_paged_kernel_rejects_tables_that_do_not_fit_the_cache():
    q, out = torch.randn(2, H, D), torch.empty(2, H, D)
    cache = torch.randn(4 * BS, KV, D)
    table, rows = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([0, 1])

    def call(table=table, lens=(3, 5), rows=rows, q=q):
        tables = PagedTables.build(rows, table, torch.tensor(lens, dtype=torch.int32), BS)
        decode_attention.decode_attention(q, out, cache, cache, tables, BS, 1.0)

    call()
    with pytest.raises(ValueError, match="out of range"):
        call(lens=(3, 2 * BS + 1))  # more keys than the table's blocks hold
    with pytest.raises(ValueError, match="out of range"):
        call(lens=(0, 5))
    with pytest.raises(ValueError, match="out of range"):
        call(table=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32))  # block 4 is past the cache
    with pytest.raises(ValueError, match="out of range"):
        call(rows=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="float32"):
        call(q=q.double())


def test_tables_from_lists_are_checked_like_built_ones():
    """The engine's path (Python lists, a step's tables padded to one width): the tensors build gives, and
    its range errors; tables of unequal widths are refused."""
    rows, tables, lens = [0, 2], [[3, 1, 4], [1, 5, 9]], [9, 12]
    listed = PagedTables.from_lists(rows, tables, lens, BS, torch.device("cpu"))
    built = PagedTables.build(torch.tensor(rows), torch.tensor(tables, dtype=torch.int32),
                              torch.tensor(lens, dtype=torch.int32), BS)
    assert all(torch.equal(getattr(listed, f), getattr(built, f)) for f in ("rows", "block_tables", "lens"))
    assert (listed.blocks_needed, listed.rows_needed) == (built.blocks_needed, built.rows_needed) == (10, 3)
    for bad_tables, bad_lens in (([[3, 1, 4], [1, -5, 9]], lens), (tables, [9, 3 * BS + 1])):
        with pytest.raises(ValueError, match="out of range"):  # a negative block; more keys than blocks
            PagedTables.from_lists(rows, bad_tables, bad_lens, BS, torch.device("cpu"))
    with pytest.raises(ValueError, match="one width"):
        PagedTables.from_lists(rows, [[3, 1, 4], [1, 5]], lens, BS, torch.device("cpu"))
