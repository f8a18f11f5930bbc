"""A tiny random Llama with a byte-level tokenizer, built offline in well under a second.

Random weights decode repetitive text: tests assert on ids, lengths, shapes and
consistency, never on words. Head dim 32 keeps it usable by vLLM's CPU attention.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )


def build_tiny_llama(folder: Path, *, layers: int = 3, seed: int = 0, max_len: int = 512) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_len,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the default init, so greedy argmax has clear winners
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build_eos_free_llama(folder: Path, *, max_len: int = 4096) -> Path:
    """The tiny Llama, except that greedy decoding never picks EOS.

    Its ``lm_head`` row for EOS is zeroed, so the EOS logit is exactly 0 while the best of
    the other random logits is positive: a greedy generation always runs to
    ``max_tokens``, on every protocol (Salience and GraphPipe cannot ask to ignore EOS).
    With a 4k context a generation runs for seconds: long enough to act on mid-stream.
    """
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    build_tiny_llama(folder, max_len=max_len)
    eos = AutoConfig.from_pretrained(folder).eos_token_id
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"][eos] = torch.zeros_like(weights["lm_head.weight"][eos])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def build_random_pack(
    folder: Path, model_dir: Path, *, layers: tuple[int, ...] = (0, 1), n_concepts: int = 3, seed: int = 0
) -> Path:
    """A concept pack of random unit directions: enough to test shapes and arithmetic."""
    import json

    from prismgate.engines.readouts.pack import ConceptPack

    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    rng = np.random.default_rng(seed)
    d = rng.standard_normal((len(layers), n_concepts, hidden)).astype(np.float32)
    d /= np.linalg.norm(d, axis=-1, keepdims=True)
    pack = ConceptPack(
        directions=d,
        layers=layers,
        concepts=tuple(f"concept{i}" for i in range(n_concepts)),
        model_id=model_dir.name,
        method="random unit vectors (tests)",
    )
    path = folder / "tiny-pack.safetensors"
    pack.save(path)
    return path
