"""Make a small Llama with random weights and a word-level tokenizer, on the spot (no download).

The weights are drawn wide (``--init``), so that greedy answers depend on every token of the
prompt: a KV cache that arrived wrong changes them. ``--layers``, ``--kv-heads`` and
``--head-dim`` set how many bytes of KV each token takes (``2 * layers * kv_heads * head_dim``
elements), which the benchmark turns up to MiBs per request.

    python examples/vllm/make_model.py /tmp/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

_PARAGRAPH = (
    "the a of and to in is you that it he was for on are as with his they I at be this have "
    "from or one had by word but not what all were we when your can said there use an each "
    "which she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part "
    "over new sound take only little work know place year live me back give most very after "
    "thing our just name good sentence man think say great where help through much before line "
    "right too mean old any same tell boy follow came want show also around form three small "
    "set put end does another well large must big even such because turn here why ask went "
    "men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn "
    "should America world high every near add food between own below country plant last "
    "school father keep tree never start city earth eye light thought head under story saw "
    "left few while along might close something seem next hard open example begin life always"
)
#: The tokenizer's words; prompts built from them tokenize one token per word.
WORDS = tuple(_PARAGRAPH.split())


def make_model(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    init: float = 0.3,
    seed: int = 0,
) -> Path:
    """Write config, weights (safetensors) and tokenizer of a random Llama to ``out``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=16384,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=init,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    # No end-of-sequence stops: answers run to max_tokens, so runs compare token for token.
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    return out


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token takes in the model ``make_model`` makes."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--init", type=float, default=0.3)
    args = parser.parse_args()
    make_model(
        args.out,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        init=args.init,
    )
    print(args.out)


if __name__ == "__main__":
    main()
