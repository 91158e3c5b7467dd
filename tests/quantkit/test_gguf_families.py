"""GGUF loading for every family quantkit runs that transformers reads from GGUF (quantkit/models/gguf_file.py).

Each tiny random-weight model is written into a GGUF file the way llama.cpp's convert_hf_to_gguf.py writes it
(gguf-py's tensor names and metadata keys for the architecture, llama's Q/K rows permuted, Gemma's norms + 1, MoE
experts stacked per projection, 1-d tensors in F32); the file read back by transformers is the original model (so
the writer is right), and quantkit's logits equal transformers' own from_pretrained(gguf_file=...) within 1e-4 in
fp32, from F32 files and from Q8_0 / Q4_0 quantized ones. Files transformers reads into another model are refused.
Configs keep the values transformers assumes for what its GGUF reader does not read (Qwen3's head_dim 128, the
Qwen MoE expert sizes, Gemma's query_pre_attn_scalar 256 and soft-caps).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from quantkit.errors import QuantkitError
from quantkit.models.loader import bundled_gguf, load_model
from tests.quantkit.families import LONGROPE, WINDOW, random_hf_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest

VOCAB = 512  # the bundled GGUF's first 512 tokens and the merges among them
MOE = dict(num_experts=4, num_experts_per_tok=2)
# family -> (transformers model_type, config beyond tests/quantkit/families.py's BASE, llama.cpp architecture)
FAMILIES = {
    "llama": ("llama", {}, gguf.MODEL_ARCH.LLAMA),
    "qwen2": ("qwen2", {}, gguf.MODEL_ARCH.QWEN2),
    "qwen2_moe": ("qwen2_moe", MOE, gguf.MODEL_ARCH.QWEN2MOE),
    "qwen3": ("qwen3", dict(head_dim=128), gguf.MODEL_ARCH.QWEN3),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, norm_topk_prob=True, **MOE), gguf.MODEL_ARCH.QWEN3MOE),
    "phi3": ("phi3", {}, gguf.MODEL_ARCH.PHI3),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=WINDOW), gguf.MODEL_ARCH.GEMMA2),
    "gemma3": ("gemma3_text", dict(head_dim=16, num_hidden_layers=6, sliding_window=WINDOW), gguf.MODEL_ARCH.GEMMA3),
}
IDS = torch.randint(0, VOCAB, (2, 2 * WINDOW), generator=torch.Generator().manual_seed(9))


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """Converted folders go to a temporary QUANTKIT_CACHE, not the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QUANTKIT_CACHE", str(tmp_path_factory.mktemp("quantkit-cache")))
        yield


@pytest.fixture(scope="module")
def vocab():
    """(tokens, token types, merges) of a 512-token byte-level BPE cut from the bundled GGUF's tokenizer."""
    src = gguf.GGUFReader(bundled_gguf())
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    merges = [m for m in src.fields["tokenizer.ggml.merges"].contents()
              if all(part in kept for part in m.split(" ")) and m.replace(" ", "") in kept]
    return tokens, src.fields["tokenizer.ggml.token_type"].contents()[:VOCAB], merges


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order for llama-arch files: within each head, (half, pair) -> (pair, half)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_cpp_tensors(hf, arch):
    """(GGUF name, tensor) of every weight, renamed and transformed as convert_hf_to_gguf.py does."""
    cfg = hf.config
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    gemma = arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)
    for hf_name, t in hf.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, leaf = hf_name.rpartition(".")
        if base.endswith(".experts"):  # transformers 5: gate_up_proj [E, 2I, H], down_proj [E, H, I]
            parts = dict(zip(("gate_proj", "up_proj"), t.chunk(2, dim=1))) if leaf == "gate_up_proj" else {leaf: t}
            for part, w in parts.items():
                yield names.get_name(f"{base}.{part}") + ".weight", w
            continue
        if arch == gguf.MODEL_ARCH.LLAMA and base.endswith(("q_proj", "k_proj")):
            t = permute(t, cfg.num_attention_heads if base.endswith("q_proj") else cfg.num_key_value_heads)
        if gemma and hf_name.endswith("norm.weight"):
            t = t + 1  # llama.cpp stores Gemma's (1 + w)
        yield f"{names.get_name(base)}.{leaf}", t.squeeze()  # Qwen2-MoE's shared_expert_gate [1, H] -> [H]


def write_gguf(path, hf, arch, vocab, quant=None, name="tiny", extra_tensors=()):
    """hf as llama.cpp would convert it: metadata, tokenizer, tensors (F32, or `quant` for >= 2-d ones)."""
    cfg = hf.config
    rope = cfg.rope_parameters
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    if arch in (gguf.MODEL_ARCH.LLAMA, gguf.MODEL_ARCH.PHI3):
        w.add_rope_dimension_count(head_dim)
    if arch == gguf.MODEL_ARCH.LLAMA:
        w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))  # Mixtral
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == gguf.MODEL_ARCH.PHI3:
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_sliding_window(cfg.sliding_window or 0)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        w.add_sliding_window(cfg.sliding_window)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant is None else gguf.LlamaFileType[f"MOSTLY_{quant.name}"])
    tokens, token_types, merges = vocab
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    for gname, t in [*llama_cpp_tensors(hf, arch), *extra_tensors]:
        data = t.detach().float().contiguous().numpy()
        if quant is not None and data.ndim >= 2 and data.shape[-1] % 32 == 0:
            w.add_tensor(gname, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny(name: str):
    model_type, extra, arch = FAMILIES[name]
    return random_hf_model(model_type, vocab_size=VOCAB, **extra), arch


@torch.no_grad()
def transformers_logits(path) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return hf(IDS).logits


@pytest.mark.parametrize("name", list(FAMILIES))
@torch.no_grad()
def test_quantkit_reads_the_gguf_as_transformers_does(name, tmp_path, vocab):
    hf, arch = tiny(name)
    path = write_gguf(tmp_path / f"{name}.gguf", hf, arch, vocab, name=name)
    expected = transformers_logits(path)
    torch.testing.assert_close(expected, hf(IDS).logits, atol=1e-4, rtol=0)  # the file is the model
    loaded = load_model(str(path))
    assert loaded.model.config.model_type == FAMILIES[name][0]
    assert loaded.hf_config["torch_dtype"] == "float32"  # random fp32 weights: not float16 values
    torch.testing.assert_close(loaded.model(IDS), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, quant", [("llama", gguf.GGMLQuantizationType.Q8_0),
                                         ("qwen3_moe", gguf.GGMLQuantizationType.Q4_0)])
@torch.no_grad()
def test_quantized_gguf_is_dequantized_exactly(name, quant, tmp_path, vocab):
    hf, arch = tiny(name)
    path = write_gguf(tmp_path / f"{name}-{quant.name}.gguf", hf, arch, vocab, quant=quant)
    reader = gguf.GGUFReader(path)
    assert {t.tensor_type for t in reader.tensors if len(t.shape) >= 2} == {quant}
    expected = transformers_logits(path)
    assert (expected - hf(IDS).logits).abs().max() > 1e-3  # quantized: not the fp32 model any more
    torch.testing.assert_close(load_model(str(path)).model(IDS), expected, atol=1e-4, rtol=0)


def test_files_transformers_reads_into_another_model_or_not_at_all_are_refused(tmp_path, vocab):
    """Mixtral is a llama GGUF whose experts transformers does not read; Phi-3 longrope's factors are tensors it
    does not place; a llama GGUF named exactly "mistral" it tries to build as Mistral and fails; an architecture
    outside the table is refused before any tensor is read."""
    mixtral = random_hf_model("mixtral", vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2)
    path = write_gguf(tmp_path / "mixtral.gguf", mixtral, gguf.MODEL_ARCH.LLAMA, vocab)
    with pytest.raises(QuantkitError, match="transformers .* without .* of its weights"):
        load_model(str(path))
    phi3 = random_hf_model("phi3", vocab_size=VOCAB, original_max_position_embeddings=64, rope_scaling=LONGROPE)
    factors = [(gguf.TENSOR_NAMES[t] + ".weight", torch.tensor(LONGROPE[k]))
               for t, k in ((gguf.MODEL_TENSOR.ROPE_FACTORS_LONG, "long_factor"),
                            (gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT, "short_factor"))]
    path = write_gguf(tmp_path / "phi3-longrope.gguf", phi3, gguf.MODEL_ARCH.PHI3, vocab, extra_tensors=factors)
    with pytest.raises(QuantkitError, match="places .* of this GGUF's .* weights"):
        load_model(str(path))
    llama, _ = tiny("llama")
    path = write_gguf(tmp_path / "mistral.gguf", llama, gguf.MODEL_ARCH.LLAMA, vocab, name="mistral")
    with pytest.raises(QuantkitError, match="transformers .* cannot read this GGUF"):
        load_model(str(path))
    w = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(QuantkitError, match="GGUF architecture 'gpt2' is not one quantkit loads"):
        load_model(str(tmp_path / "gpt2.gguf"))
