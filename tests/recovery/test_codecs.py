"""L codecs against simpler references: group-wise = per-row codec on each group's slice,
outliers kept exact, stored bytes counted exactly, and the ordering real activations need."""

import pytest
import torch

from hilore_actor.recovery import CODECS, get_codec, reconstruction_error
from hilore_actor.recovery.codecs import AbsmaxCodec


def _seeded():
    seed = torch.seed() % 2**31
    print("seed", seed)
    return torch.Generator().manual_seed(seed)


def _outlier_activation(gen, rows=64, cols=576, channel=None, gain=60.0):
    """Gaussian activations with one channel ``gain`` times larger, as real LLMs have."""
    x = torch.randn(rows, cols, generator=gen)
    c = int(torch.randint(0, cols, (), generator=gen)) if channel is None else channel
    x[:, c] *= gain
    return x


@pytest.mark.parametrize("name", sorted(CODECS))
@pytest.mark.parametrize("shape", [(2, 7, 96), (3, 100), (130,), ()])
def test_roundtrip_keeps_shape_dtype_and_counts_bytes(name, shape):
    gen = _seeded()
    codec = get_codec(name)
    x = torch.randn(shape, generator=gen)
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    stored = [p.data, p.scale, *p.extra]
    assert p.nbytes == sum(t.numel() * t.element_size() for t in stored)
    if x.numel() >= 96:
        assert p.nbytes < x.numel() * x.element_size()
        bound = {"int2": 0.95, "fp8-e5m2": 0.2}.get(name, 0.08)  # int2: ternary, a control's codec
        assert reconstruction_error(x, codec) < bound


@pytest.mark.parametrize(
    "name,group,qdtype",
    [
        ("int8-g64", 64, torch.int8),
        ("int8-g128", 128, torch.int8),
        ("fp8-e4m3-b32", 32, getattr(torch, "float8_e4m3fn", None)),
    ],
)
def test_group_codec_equals_the_per_row_codec_on_each_group(name, group, qdtype):
    if name not in CODECS:
        pytest.skip("no float8 dtypes in this torch build")
    gen = _seeded()
    cols = group * 3 + 17  # a ragged last group
    x = _outlier_activation(gen, rows=9, cols=cols)
    per_row = AbsmaxCodec("ref", qdtype, 127.0 if qdtype == torch.int8 else 448.0, rounding=qdtype == torch.int8)
    ref = torch.cat([per_row.decode(per_row.encode(x[:, a : a + group])) for a in range(0, cols, group)], dim=1)
    assert torch.equal(get_codec(name).decode(get_codec(name).encode(x)), ref)


def test_outlier_codec_keeps_the_outlier_channels_exact():
    gen = _seeded()
    x = _outlier_activation(gen)
    c = int(x.abs().amax(0).argmax())
    y = get_codec("int8-outlier").decode(get_codec("int8-outlier").encode(x))
    assert torch.equal(y[:, c], x[:, c])
    rest = torch.ones(x.shape[1], dtype=torch.bool)
    rest[c] = False
    per_row = get_codec("int8")
    assert torch.allclose(y[:, rest], per_row.decode(per_row.encode(x[:, rest])), atol=x[:, rest].abs().max() / 127)


def test_an_outlier_channel_orders_the_codecs():
    """With one outlier channel, group-wise int8 beats per-token int8, keeping the
    outlier exact beats both, and bf16 is the most accurate."""
    gen = _seeded()
    x = _outlier_activation(gen)
    err = {n: reconstruction_error(x, get_codec(n)) for n in ("int8", "int8-g128", "int8-g64", "int8-outlier", "bf16")}
    print(err)
    assert err["int8-g64"] < err["int8-g128"] < err["int8"]
    assert err["int8-outlier"] < err["int8-g64"]
    assert err["bf16"] < err["int8-outlier"]


def test_non_finite_tensors_are_flagged_for_exact_storage():
    """Additive -inf attention masks: every codec flags them, so the engine keeps them exact
    (and shared across layers); a finite tensor is never flagged."""
    mask = torch.zeros(4, 64)
    mask[:, 40:] = float("-inf")
    for name in CODECS:
        assert not get_codec(name).encode(mask).finite(), name
        assert get_codec(name).encode(torch.randn(4, 64)).finite(), name


@pytest.mark.parametrize("name", ["int8-g64", "int8-g128", "fp8-e4m3-b32"])
def test_a_row_narrower_than_a_group_is_one_unpadded_group(name):
    """LoRA's rank-r intermediates: one scale per row, no padding to the group's width."""
    seed = torch.seed() % 2**31
    print("seed", seed)
    if name not in CODECS:
        pytest.skip(f"{name} needs float8 dtypes")
    x = torch.randn(100, 4, generator=torch.Generator().manual_seed(seed))
    codec = get_codec(name)
    p = codec.encode(x)
    assert p.nbytes == 100 * 4 * p.data.element_size() + 100 * 4  # values + one float32 scale per row
    assert torch.allclose(codec.decode(p), x, rtol=0.1, atol=0.05 * float(x.abs().max()))


@pytest.mark.parametrize("codec", ["int8", "int8-g64", "bf16"])
def test_row_split_keeps_its_rows_exact_and_compresses_the_rest(codec):
    """``RowSplit`` (token L): the kept rows come back bitwise, the others as the codec alone
    gives them; its bytes are the kept rows' plus the codec's payload of the others."""
    from hilore_actor.recovery.codecs import RowSplit, get_codec

    seed = torch.seed() % 2**31
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 80, generator=g)
    order = torch.randperm(18, generator=g)
    kept, rest = order[:5], order[5:]
    c = get_codec(codec)
    p = RowSplit.encode(c, x, kept, rest)
    y = p.decode().reshape(18, 80)
    rows = x.reshape(18, 80)
    assert torch.equal(y[kept], rows[kept])
    assert torch.equal(y[rest], c.decode(c.encode(rows[rest])).reshape(13, 80))
    assert p.nbytes == 5 * 80 * 4 + c.encode(rows[rest]).nbytes
    assert torch.equal(RowSplit.encode(c, x, order, order[:0]).decode(), x)  # every row kept: exact


@pytest.mark.parametrize("name", sorted(CODECS))
def test_keep_sign_never_decodes_a_nonzero_value_to_zero_or_the_other_sign(name):
    """Small values next to a large one (a ReLU output: most far below half an int8 quantum):
    with ``keep_sign`` every nonzero value keeps its sign and zeros stay zero; the error of
    each value stays within one quantum of its row; without it int8 flushes them to zero."""
    gen = _seeded()
    x = torch.randn(16, 96, generator=gen) * 1e-3
    x[:, 0] = 10.0
    x[:, 1] = 0.0
    codec = get_codec(name)
    y = codec.decode(codec.encode(x, keep_sign=True))
    assert torch.equal(torch.sign(y), torch.sign(x))
    quantum = x.abs().amax(-1, keepdim=True) / (1.0 if name == "int2" else 127.0)  # int2: {-1, 0, 1}
    assert ((y - x).abs() <= quantum * 1.0001).all()
    if name == "int8":
        assert (codec.decode(codec.encode(x)) == 0).float().mean() > 0.9  # round to nearest: the small ones are gone
