"""Tiny random-weight models written at test time, offline (no hub).

Each model is a transformers config, ``AutoModelForCausalLM.from_config`` with every weight matrix drawn
at std 0.1 (a wider spread than the init's 0.02 gives usable top-2 logit margins for greedy comparisons),
saved with ``save_pretrained``, and a byte-level BPE tokenizer of about 512 tokens trained with
``tokenizers`` on a fixed text and saved as a ``PreTrainedTokenizerFast``. 6-16 MB each, a few seconds.

Run in the serving venv (it needs torch and transformers); the models are fp32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 512
SEED = 1234

# The tokenizer's training text: fixed, so every build gives the same vocabulary.
_WORDS = (
    "the of and to in is was for on as with by at from his her an which are this be or had not but "
    "prefill decode block cache token head layer state transfer engine request prompt model geometry "
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain forest ocean "
    "north south east west one two three four five six seven eight nine ten hundred thousand"
).split()

PROMPTS = (  # 40-160 tokens: one to five 32-token blocks, partial last blocks
    "the river north of the mountain was one of the forest states " * 3,
    "prefill and decode share a block cache of every token head and layer " * 5,
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega " * 6,
    "one two three four five six seven eight nine ten hundred thousand " * 13,
)


def _corpus() -> list[str]:
    lines = []
    for i in range(400):
        lines.append(" ".join(_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(24)))
    return lines + list(PROMPTS)


def build_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 2,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def _dense_config() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        dtype="float32",
    )


def _nemotron_h_config() -> Any:
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        hybrid_override_pattern="M*M-",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        mamba_num_heads=8,
        mamba_head_dim=32,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        dtype="float32",
    )


MODELS = {"dense": _dense_config, "nemotron_h": _nemotron_h_config}


def build_model(name: str, path: Path) -> Path:
    """Write model ``name`` (``dense`` or ``nemotron_h``) into ``path`` and return it."""
    import torch
    from transformers import AutoModelForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    config = MODELS[name]()
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # matrices (embeddings, projections, the conv); norms and SSM scalars keep init
                p.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    build_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    return path


if __name__ == "__main__":  # python tests/serving/_models.py NAME DIR
    import sys

    print(build_model(sys.argv[1], Path(sys.argv[2])))
