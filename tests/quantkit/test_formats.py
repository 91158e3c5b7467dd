"""formats/{gptq,awq,compressed_tensors}.py: every layout round-trips the canonical QTensor bit-exactly, the tensors
sit where FORMATS.md (and the vLLM/AutoAWQ/compressed-tensors readers) expect them, checked with bit-level Python
references written from FORMATS.md, and refusals name the layer and the way out."""

from __future__ import annotations

import itertools

import pytest
import torch

from quantkit.config import QuantScheme
from quantkit.errors import QuantkitError
from quantkit.formats import awq, compressed_tensors, gptq
from quantkit.quant.scheme import QTensor, dequantize, fit_qparams, quantize, quantize_rtn

N, K = 64, 256
MODULE = "model.layers.0.mlp.up_proj"


def make_qtensor(bits, group_size, sym, act_order=False, seed=0, n=N, k=K) -> QTensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym, act_order=act_order)
    if not act_order:
        return quantize_rtn(w, scheme)
    order = torch.randperm(k, generator=gen)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group_size).to(torch.int32)
    scales, zeros = fit_qparams(w, scheme, g_idx)
    return QTensor(quantize(w, scales, zeros, bits, group_size, g_idx), zeros, scales, g_idx, bits, group_size, sym)


def write(layout: str, qt: QTensor) -> dict[str, torch.Tensor]:
    if layout in ("gptq", "gptq_v2"):
        return gptq.linear_tensors(qt, MODULE, v1=layout == "gptq")
    if layout == "awq":
        return awq.linear_tensors(qt, MODULE)
    return compressed_tensors.linear_tensors(qt, MODULE)


def read(layout: str, tensors: dict, scheme: QuantScheme) -> QTensor:
    if layout in ("gptq", "gptq_v2"):
        return gptq.read_linear(tensors, gptq.quantization_config(scheme, layout, "llama", []), MODULE)
    if layout == "awq":
        return awq.read_linear(tensors, awq.quantization_config(scheme, []), MODULE)
    return compressed_tensors.read_linear(tensors, compressed_tensors.quantization_config(scheme, []), MODULE)


def allowed(layout, bits, group_size, sym, act_order) -> bool:
    if layout == "gptq":
        return sym
    if layout == "gptq_v2":
        return True
    if layout == "awq":
        return bits == 4 and group_size != -1 and not act_order
    return not act_order  # compressed-tensors 0.20 removed g_idx act-order


CASES = [
    (layout, bits, g, sym, act)
    for layout, bits, g, sym, act in itertools.product(
        ["gptq", "gptq_v2", "awq", "compressed-tensors"], [4, 8], [32, 64, 128, -1], [True, False], [False, True])
    if allowed(layout, bits, g, sym, act) and not (act and g == -1)
]


@pytest.mark.parametrize("layout,bits,group_size,sym,act_order", CASES)
def test_every_layout_round_trips_bit_exactly(layout, bits, group_size, sym, act_order):
    qt = make_qtensor(bits, group_size, sym, act_order, seed=bits + group_size)
    scheme = QuantScheme(bits=bits, group_size=group_size, sym=sym, act_order=act_order)
    assert qt.equal(read(layout, write(layout, qt), scheme))


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_same_codes_dequantize_identically_in_gptq_v2_awq_and_compressed_tensors(sym, group_size):
    qt = make_qtensor(4, group_size, sym, seed=7)
    scheme = QuantScheme(bits=4, group_size=group_size, sym=sym)
    weights = [dequantize(read(layout, write(layout, qt), scheme)) for layout in ("gptq_v2", "awq", "compressed-tensors")]
    assert torch.equal(weights[0], weights[1]) and torch.equal(weights[0], weights[2])
    assert torch.equal(weights[0], dequantize(qt))


@pytest.mark.parametrize("bits,word", [(4, 0x77777777), (8, 0x7F7F7F7F)])
def test_symmetric_gptq_v1_qzeros_words(bits, word):
    qt = make_qtensor(bits, 32, sym=True)
    qzeros = gptq.linear_tensors(qt, MODULE, v1=True)["qzeros"]
    assert qzeros.shape == (K // 32, N * bits // 32) and qzeros.dtype == torch.int32
    assert bool((qzeros == word).all())
    # v2 stores the true zero (8 / 128): 0x88888888 / 0x80808080 as signed int32
    v2 = gptq.linear_tensors(qt, MODULE, v1=False)["qzeros"]
    true_word = 0x88888888 if bits == 4 else 0x80808080
    assert bool((v2 == true_word - (1 << 32)).all())


def test_gptq_v1_refuses_asymmetric_zero_points_and_says_what_to_use():
    qt = make_qtensor(4, 32, sym=False)
    with pytest.raises(QuantkitError, match=rf"layer {MODULE}: GPTQ v1 .* cannot hold asymmetric zero points.*use --format gptq_v2, awq or compressed-tensors"):
        gptq.linear_tensors(qt, MODULE, v1=True)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_qweight_bit_positions_match_formats_md(bits):
    """Element (k, n) of Q.T sits in word [k // p, n] at bit offset bits * (k % p); qzeros (grp, n) in
    word [grp, n // p] at bits * (n % p); scales [G, N]; g_idx [K]."""
    n, k, g = 16, 64, 32
    qt = make_qtensor(bits, g, sym=False, seed=11, n=n, k=k)
    t = gptq.linear_tensors(qt, MODULE, v1=False)
    p, mask = 32 // bits, (1 << bits) - 1
    qweight = t["qweight"].tolist()
    qzeros = t["qzeros"].tolist()
    for kk in range(k):
        for nn in range(n):
            assert (qweight[kk // p][nn] >> (bits * (kk % p))) & mask == qt.codes[nn, kk].item()
    for grp in range(k // g):
        for nn in range(n):
            assert (qzeros[grp][nn // p] >> (bits * (nn % p))) & mask == qt.zeros[nn, grp].item()
    assert t["qweight"].shape == (k // p, n) and t["qzeros"].shape == (k // g, n // p)
    assert torch.equal(t["scales"], qt.scales.T) and t["scales"].dtype == torch.float16
    assert torch.equal(t["g_idx"], (torch.arange(k) // g).to(torch.int32))


def test_awq_qweight_of_a_tiny_layer_unpacks_with_reverse_order():
    """Column 8c + j of row k = (qweight[k, c] >> 4 * REVERSE[j]) & 0xF (FORMATS.md), written here in Python ints."""
    reverse = [0, 4, 1, 5, 2, 6, 3, 7]
    n, k, g = 16, 64, 32
    qt = make_qtensor(4, g, sym=False, seed=5, n=n, k=k)
    t = awq.linear_tensors(qt, MODULE)
    assert t["qweight"].shape == (k, n // 8) and t["qzeros"].shape == (k // g, n // 8)
    qweight, qzeros = t["qweight"].tolist(), t["qzeros"].tolist()
    for kk in range(k):
        for c in range(n // 8):
            for j in range(8):
                assert (qweight[kk][c] >> (4 * reverse[j])) & 0xF == qt.codes[8 * c + j, kk].item()
    for grp in range(k // g):
        for c in range(n // 8):
            for j in range(8):
                assert (qzeros[grp][c] >> (4 * reverse[j])) & 0xF == qt.zeros[8 * c + j, grp].item()
    assert torch.equal(t["scales"], qt.scales.T)


def test_awq_interleave_of_one_word():
    """Codes 0..7 in columns 0..7: nibble i holds column ORDER[i] = [0,2,4,6,1,3,5,7] -> word 0x75316420."""
    codes = torch.arange(8, dtype=torch.uint8).reshape(8, 1).expand(8, 32).contiguous()  # column n has code n
    qt = QTensor(codes, torch.zeros(8, 1, dtype=torch.uint8), torch.ones(8, 1, dtype=torch.float16), None, 4, 32, False)
    assert bool((awq.linear_tensors(qt, MODULE)["qweight"] == 0x75316420).all())


def test_awq_refusals_name_the_layer():
    with pytest.raises(QuantkitError, match=rf"layer {MODULE}: AWQ GEMM is 4-bit only .*gptq_v2 or compressed-tensors"):
        awq.linear_tensors(make_qtensor(8, 32, True), MODULE)
    with pytest.raises(QuantkitError, match=rf"layer {MODULE}: AWQ GEMM has no g_idx"):
        awq.linear_tensors(make_qtensor(4, 32, True, act_order=True), MODULE)
    with pytest.raises(QuantkitError, match=rf"layer {MODULE}: AWQ GEMM needs a group size"):
        awq.linear_tensors(make_qtensor(4, -1, True), MODULE)


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_tensors_equals_gptq_transposed(bits):
    """weight_packed = GPTQ qweight.T; weight_zero_point = GPTQ-v2 qzeros.T (FORMATS.md)."""
    qt = make_qtensor(bits, 64, sym=False, seed=3)
    ct = compressed_tensors.linear_tensors(qt, MODULE)
    gp = gptq.linear_tensors(qt, MODULE, v1=False)
    assert torch.equal(ct["weight_packed"], gp["qweight"].T)
    assert torch.equal(ct["weight_zero_point"], gp["qzeros"].T)
    assert ct["weight_shape"].tolist() == [N, K] and ct["weight_shape"].dtype == torch.int64
    assert torch.equal(ct["weight_scale"], qt.scales)
    assert "weight_g_idx" not in ct


def test_compressed_tensors_writes_zero_points_only_when_asymmetric():
    sym = compressed_tensors.linear_tensors(make_qtensor(4, 32, sym=True), MODULE)
    assert set(sym) == {"weight_packed", "weight_scale", "weight_shape"}
    asym = compressed_tensors.linear_tensors(make_qtensor(4, 32, sym=False), MODULE)
    assert set(asym) == {"weight_packed", "weight_scale", "weight_shape", "weight_zero_point"}


def test_compressed_tensors_refuses_g_idx_act_order_but_reads_older_folders_that_have_it():
    qt = make_qtensor(4, 32, sym=False, act_order=True)
    with pytest.raises(QuantkitError, match=rf"layer {MODULE}: compressed-tensors 0.20\+ rejects act-order .*gptq_v2"):
        compressed_tensors.linear_tensors(qt, MODULE)
    # an older llm-compressor folder: actorder "group" and weight_g_idx next to the GPTQ-equivalent tensors
    gp = gptq.linear_tensors(qt, MODULE, v1=False)
    tensors = {"weight_packed": gp["qweight"].T.contiguous(), "weight_scale": qt.scales, "weight_g_idx": qt.g_idx,
               "weight_zero_point": gp["qzeros"].T.contiguous(), "weight_shape": torch.tensor([N, K])}
    qcfg = compressed_tensors.quantization_config(QuantScheme(bits=4, group_size=32, sym=False), [])
    qcfg["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    assert qt.equal(compressed_tensors.read_linear(tensors, qcfg, MODULE))


def test_quantization_configs_carry_the_keys_readers_need():
    scheme = QuantScheme(bits=4, group_size=128, sym=True, act_order=True)
    g1 = gptq.quantization_config(scheme, "gptq", "llama", [], damp_percent=0.01)
    assert {k: g1[k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym", "checkpoint_format")} == {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "checkpoint_format": "gptq"}
    assert g1["damp_percent"] == 0.01 and g1["lm_head"] is False and g1["true_sequential"] is True
    assert g1["modules_in_block_to_quantize"][0] == ["self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj"]
    assert gptq.quantization_config(scheme, "gptq_v2", "llama", [])["checkpoint_format"] == "gptq_v2"
    static = gptq.quantization_config(QuantScheme(bits=4, group_size=128, act_order=True, static_groups=True), "gptq", "llama", [])
    assert static["desc_act"] is False and static["static_groups"] is True
    skipped = gptq.quantization_config(scheme, "gptq_v2", "llama", ["model.layers.1.mlp.down_proj"])["dynamic"]
    assert skipped == {r"-:^model\.layers\.1\.mlp\.down_proj$": {}}

    a = awq.quantization_config(QuantScheme(bits=4, group_size=128, sym=False), [])
    assert a == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                 "modules_to_not_convert": None}

    ct = compressed_tensors.quantization_config(QuantScheme(bits=8, group_size=-1, sym=False), [])
    assert ct["quant_method"] == "compressed-tensors" and ct["format"] == "pack-quantized"
    assert ct["quantization_status"] == "compressed" and ct["ignore"] == ["lm_head"] and ct["version"]
    group = ct["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    assert group["weights"] == {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel",
                                "group_size": None, "actorder": None, "dynamic": False, "observer": "minmax",
                                "observer_kwargs": {}, "block_structure": None}
    static = QuantScheme(bits=4, group_size=128, sym=True, act_order=True, static_groups=True)
    act = compressed_tensors.quantization_config(static, [])["config_groups"]["group_0"]["weights"]
    assert act["strategy"] == "group" and act["group_size"] == 128 and act["actorder"] == "weight"


def test_readers_reject_inconsistent_tensors_naming_the_layer():
    qt = make_qtensor(4, 32, sym=True)
    scheme = QuantScheme(bits=4, group_size=32)
    t = write("gptq_v2", qt)
    t["scales"] = t["scales"][:-1]
    with pytest.raises(QuantkitError, match=rf"layer {MODULE}: scales have 7 groups"):
        read("gptq_v2", t, scheme)
    t = write("compressed-tensors", qt)
    del t["weight_scale"]
    with pytest.raises(QuantkitError, match=rf"tensor {MODULE}.weight_scale is missing"):
        read("compressed-tensors", t, scheme)
