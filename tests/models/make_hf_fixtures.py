#!/usr/bin/env python3
"""Hugging Face parity fixtures for kiln's models (tests/models/hf_weights_test.cpp).

Needs torch, transformers and safetensors (the GPU machine has them; everything runs on the
CPU in f32, so the numbers do not depend on the GPU).

Make the fixtures (the C++ tests read them from tests/models/data/hf/<family>/):

    python3 tests/models/make_hf_fixtures.py --out tests/models/data/hf

For each family (llama, llama3, mistral, gemma, gemma2) it builds a small random
transformers model with torch.manual_seed(0), eager attention, f32, and writes
    config.json, model.safetensors      save_pretrained (safetensors)
    tokens.safetensors                  "tokens": int64 [2, 24], fixed
    logits.safetensors                  "logits": f32 [2, 24, vocab] of the f32 model,
                                        "logits_bf16": bf16 logits of model.to(bfloat16)

Check a directory that kiln exported (save_hf_checkpoint) with transformers:

    python3 tests/models/make_hf_fixtures.py --check-export DIR --family llama \
        [--fixtures tests/models/data/hf]

loads DIR with AutoModelForCausalLM (eager, f32), runs the fixture's tokens and prints the max
abs difference from the fixture's logits; exits 1 when it exceeds 1e-4 * max(1, max|logits|).
"""
import argparse
import copy
import inspect
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Gemma2Config, GemmaConfig, LlamaConfig,
                          MistralConfig)

SEQ = 24
VOCAB = 128
FAMILIES = ["llama", "llama3", "mistral", "gemma", "gemma2"]


def family_configs():
    """(config class, kwargs, rope parameters) per family: tiny, but each with its features."""
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, initializer_range=0.1, use_cache=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    default_rope = {"rope_type": "default", "rope_theta": 10000.0}
    return {
        # Multi-head attention, untied head.
        "llama": (LlamaConfig, dict(common, num_key_value_heads=4, intermediate_size=64,
                                    rms_norm_eps=1e-5, tie_word_embeddings=False), default_rope),
        # GQA, tied, Llama 3 RoPE scaling with a short original context so that head size 16
        # has frequencies kept (none here), interpolated (i = 0) and divided by the factor.
        "llama3": (LlamaConfig, dict(common, num_key_value_heads=2, intermediate_size=96,
                                     rms_norm_eps=1e-5, tie_word_embeddings=True),
                   {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 4.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16}),
        # GQA with a window (8) shorter than the sequence (24).
        "mistral": (MistralConfig, dict(common, num_key_value_heads=2, intermediate_size=80,
                                        rms_norm_eps=1e-5, sliding_window=8,
                                        tie_word_embeddings=False), default_rope),
        # MQA, head_dim 24 != 64 / 4.
        "gemma": (GemmaConfig, dict(common, num_key_value_heads=1, head_dim=24,
                                    intermediate_size=96, rms_norm_eps=1e-6,
                                    hidden_act="gelu_pytorch_tanh",
                                    hidden_activation="gelu_pytorch_tanh",
                                    tie_word_embeddings=True), default_rope),
        # Softcaps small enough to bend these logits, query_pre_attn_scalar != head_dim, the
        # window (8) on layer 0 only.
        "gemma2": (Gemma2Config, dict(common, num_key_value_heads=2, head_dim=24,
                                      intermediate_size=80, rms_norm_eps=1e-6,
                                      hidden_act="gelu_pytorch_tanh",
                                      hidden_activation="gelu_pytorch_tanh",
                                      query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
                                      final_logit_softcapping=3.0, sliding_window=8,
                                      tie_word_embeddings=True), default_rope),
    }


def make_config(cls, kwargs, rope):
    params = inspect.signature(cls.__init__).parameters
    kwargs = dict(kwargs)
    if "rope_parameters" in params:  # transformers 5
        kwargs["rope_parameters"] = dict(rope)
    else:
        kwargs["rope_theta"] = rope["rope_theta"]
        if rope["rope_type"] != "default":
            kwargs["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if cls is Gemma2Config and "layer_types" in params:
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                 for i in range(kwargs["num_hidden_layers"])]
    return cls(**kwargs)


def build_model(family):
    cls, kwargs, rope = family_configs()[family]
    config = make_config(cls, kwargs, rope)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    # transformers initialises every norm weight to the same value (1, or 0 for Gemma's
    # 1 + w): randomise them so that a swapped norm mapping changes the logits.
    gen = torch.Generator().manual_seed(1)
    offset = 0.0 if family.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(offset + 0.2 * torch.randn(p.shape, generator=gen))
    return model.eval()


def fixed_tokens():
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen, dtype=torch.int64)


@torch.no_grad()
def logits_of(model, tokens):
    return model(input_ids=tokens, attention_mask=torch.ones_like(tokens), use_cache=False).logits


def describe(path):
    return f"{path} ({os.path.getsize(path)} bytes)"


def make(out):
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    tokens = fixed_tokens()
    meta = {"torch": torch.__version__, "transformers": transformers.__version__}
    for family in FAMILIES:
        d = os.path.join(out, family)
        os.makedirs(d, exist_ok=True)
        model = build_model(family)
        try:
            model.save_pretrained(d, safe_serialization=True)
        except TypeError:  # transformers 5 always writes safetensors
            model.save_pretrained(d)
        logits = logits_of(model, tokens).float()
        bf16 = copy.deepcopy(model).to(torch.bfloat16)
        logits_bf16 = logits_of(bf16, tokens).to(torch.bfloat16)
        save_file({"tokens": tokens.contiguous()}, os.path.join(d, "tokens.safetensors"),
                  metadata=meta)
        save_file({"logits": logits.contiguous(), "logits_bf16": logits_bf16.contiguous()},
                  os.path.join(d, "logits.safetensors"), metadata=meta)
        print(f"{family}: {type(model).__name__}, "
              f"{sum(p.numel() for p in model.parameters())} parameters, "
              f"max|logits| {logits.abs().max().item():.4f}, "
              f"max|f32 - bf16| {(logits - logits_bf16.float()).abs().max().item():.4f}")
        total = 0
        for name in sorted(os.listdir(d)):
            path = os.path.join(d, name)
            total += os.path.getsize(path)
            print("  wrote", describe(path))
        print(f"  {family}: {total} bytes in all")


def check_export(export_dir, family, fixtures):
    d = os.path.join(fixtures, family)
    tokens = load_file(os.path.join(d, "tokens.safetensors"))["tokens"]
    expected = load_file(os.path.join(d, "logits.safetensors"))["logits"]
    model = AutoModelForCausalLM.from_pretrained(export_dir, attn_implementation="eager")
    model = model.float().eval()
    got = logits_of(model, tokens).float()
    if got.shape != expected.shape:
        print(f"{family}: {export_dir}: logits {tuple(got.shape)}, fixture "
              f"{tuple(expected.shape)}")
        return 1
    err = (got - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    ok = err <= 1e-4 * scale
    print(f"{family}: {export_dir} ({type(model).__name__}, transformers "
          f"{transformers.__version__}): max abs diff {err:.3e}, max|logits| {scale:.3f}: "
          f"{'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="directory to write <family>/ fixtures into")
    ap.add_argument("--check-export", metavar="DIR", help="a kiln-exported HF directory")
    ap.add_argument("--family", choices=FAMILIES, help="the fixture family DIR was made from")
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "data", "hf"))
    args = ap.parse_args()
    if args.check_export:
        if not args.family:
            ap.error("--check-export needs --family")
        return check_export(args.check_export, args.family, args.fixtures)
    if not args.out:
        ap.error("give --out DIR or --check-export DIR --family F")
    make(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
