"""Hugging Face model directories: config, streamed safetensors reading, streamed export.

Reading opens each shard lazily and returns one tensor at a time, so importing a model never holds
more than one block's tensors. Export writes shards of at most ``max_shard_bytes`` plus the index,
the config and the tokenizer files, so ``from_pretrained`` loads the result.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from fuyou.errors import FuyouError, os_limit_error
from fuyou.models.blocks import parse_slice
from fuyou.models.multimodal import UNTRAINED, TextPart, find_text_part, is_multimodal_store, text_config

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",  # a multimodal model's image (and video) processing, kept for export
    "processor_config.json",
    "video_preprocessor_config.json",
)


class ModelFileError(FuyouError):
    """A model directory or one of its files is missing, unreadable or inconsistent."""


def load_config(model_dir: str, whole: bool = False) -> Any:
    """Read ``model_dir/config.json`` with transformers (local files only): the config Fuyou trains with
    (a multimodal checkpoint's ``text_config``: ``multimodal.text_config``), or with ``whole`` the file's
    own.

    Raises ModelFileError if the directory or config is missing or unreadable, ConfigError for a
    multimodal checkpoint whose text model is no causal LM.
    """
    from transformers import AutoConfig

    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ModelFileError(
            f"{model_dir} is not a model directory (no config.json); pass a Hugging Face model directory"
        )
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except (ValueError, OSError, KeyError) as e:
        raise (os_limit_error(e, f"reading {path}", probe=path) or ModelFileError(f"cannot read {path}: {e}")) from e
    return config if whole else text_config(config)


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""safetensors' names of the floating-point dtypes a checkpoint's weights come in."""


def widest_float(dtypes: Iterable[torch.dtype]) -> torch.dtype | None:
    """The dtype that holds every floating-point value of ``dtypes`` exactly, capped at fp32 (a model's
    "own dtype": fp32, fp16 or bf16; fp16 and bf16 together need fp32); None without any."""
    floats = {d for d in dtypes if d.is_floating_point}
    if len(floats) == 1 and torch.float64 not in floats:
        return floats.pop()
    return torch.float32 if floats else None


class CheckpointReader:
    """Tensors of a model directory's safetensors files (sharded or not), read one at a time.

    With ``model_type``, a parameter stored in the family's on-disk layout rather than the model's is
    rebuilt the way ``transformers`` loads it, from its conversion mapping for that family
    (``transformers.conversion_mapping``): renamed modules (Mixtral's ``block_sparse_moe`` → ``mlp``)
    and fused experts (``experts.gate_up_proj`` [E, 2I, h] from every expert's gate and up
    projections, ``experts.down_proj`` [E, h, I] from their down projections). Quantized weights are
    dequantized as they are read, one tensor at a time: MXFP4 experts (GPT-OSS, ``mxfp4_dequantize``)
    and block-scaled FP8 (DeepSeek-V3, ``fp8_dequantize``). In a multimodal checkpoint the keys are the
    language model's (``multimodal.TextPart``): ``model.…`` and ``lm_head.…`` are read where it keeps
    them."""

    def __init__(self, model_dir: str, model_type: str | None = None) -> None:
        self.model_dir = model_dir
        self._open: dict[str, Any] = {}
        self._renames, self._merges = _conversions(model_type)
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        if os.path.isfile(index):
            with open(index) as f:
                self.where: dict[str, str] = json.load(f)["weight_map"]
        elif os.path.isfile(single):
            self.where = {k: "model.safetensors" for k in self._keys("model.safetensors")}
        else:
            raise ModelFileError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
        _check_quantization(model_dir)
        self.part: TextPart | None = find_text_part(model_dir, self.where)
        """Where a multimodal checkpoint keeps the language model (None: a text-only checkpoint)."""
        self.fp8_block = _fp8_block(model_dir) if any(k.endswith(FP8_SCALE) for k in self.where) else None
        """The FP8 weights' block (rows, columns), from ``quantization_config`` (None: no FP8 weights)."""

    def _handle(self, fname: str) -> Any:
        """The open safetensors file ``fname``.

        Raises SystemLimitError if an OS limit (open files, memory) stops it, else ModelFileError.
        """
        from safetensors import safe_open

        if fname not in self._open:
            path = os.path.join(self.model_dir, fname)
            try:
                self._open[fname] = safe_open(path, framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise (
                    os_limit_error(e, f"reading {path}", probe=path)
                    or ModelFileError(f"cannot read {path}: {e}; the file is missing or corrupt")
                ) from e
        return self._open[fname]

    def _keys(self, fname: str) -> list[str]:
        return list(self._handle(fname).keys())

    def close(self) -> None:
        """Drop the open shards (and their memory maps, whose touched pages count as resident)."""
        self._open.clear()

    def dtype(self) -> torch.dtype | None:
        """The checkpoint's dtype (``widest_float`` of its floating-point tensors, read from the files'
        headers; None if it has none); raises ModelFileError / SystemLimitError as ``get``."""
        found = {self._handle(f).get_slice(k).get_dtype() for k, f in self.where.items() if self._trained(k)}
        self.close()
        return widest_float(SAFETENSORS_DTYPES[d] for d in found if d in SAFETENSORS_DTYPES)

    def _trained(self, disk_key: str) -> bool:
        return self.part is None or self.part.owns(disk_key)

    def untrained(self) -> list[str]:
        """A multimodal checkpoint's tensors outside its language model (vision tower, projector), as
        stored; none for a text-only checkpoint."""
        return [k for k in self.where if not self._trained(k)]

    def read_stored(self, disk_key: str) -> torch.Tensor:
        """The tensor stored as ``disk_key``, as it is (no renaming, conversion or dequantization)."""
        return self._read_stored(disk_key)

    def __contains__(self, key: str) -> bool:
        return (self.part.disk_key(key) if self.part else key) in self.where

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (rebuilt from the family's on-disk layout where it is stored so: see the
        class docstring), or for a ``slice_key`` (an expert group's) its rows only, reading no other
        expert's; raises ModelFileError if absent or unreadable, SystemLimitError if an OS limit
        (open files, memory) stops the read."""
        rows = parse_slice(key)
        if self.part is not None:
            key = self.part.disk_key(key if rows is None else rows[0])
            rows = None if rows is None else (key, rows[1], rows[2])
        if rows is not None:
            return self._rows(*rows)
        if key not in self.where:
            return self._converted(key)
        return self._read(key)

    def _rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of dim 0 of the tensor ``key``."""
        if key in self.where or self._on_disk(key) in self.where:
            name = key if key in self.where else self._on_disk(key)
            return self._read(name, (lo, hi))
        return self._converted(key, (lo, hi))

    def _on_disk(self, key: str) -> str:
        """``key`` under the family's on-disk module names (the renamings undone)."""
        for disk, model in self._renames:
            key = key.replace(model, disk)
        return key

    def _converted(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """A parameter the checkpoint stores in the family's own layout: renamed, merged experts, or
        MXFP4-packed experts (``rows``: experts [lo, hi) only)."""
        if self._on_disk(key) in self.where:
            return self._read(self._on_disk(key))
        packed = self._on_disk(key)
        if packed + MXFP4_BLOCKS in self.where and packed + MXFP4_SCALES in self.where:
            return mxfp4_dequantize(self._read(packed + MXFP4_BLOCKS, rows), self._read(packed + MXFP4_SCALES, rows))
        for sources, target in self._merges:
            if key.endswith(target):
                base = self._on_disk(key[: len(key) - len(target)])
                count = 0
                while all(base + s.replace("*", str(count)) in self.where for s in sources):
                    count += 1
                lo, hi = rows or (0, count)
                if count and hi <= count:
                    return torch.stack(
                        [torch.cat([self._read(base + s.replace("*", str(e))) for s in sources]) for e in range(lo, hi)]
                    )
        raise ModelFileError(f"{self.model_dir} has no tensor {key!r}; is this the right model?")

    def _read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        scales = key + FP8_SCALE
        if self.fp8_block is None or scales not in self.where:
            return self._read_stored(key, rows)
        if rows is not None and len(self._handle(self.where[key]).get_slice(key).get_shape()) == 3:
            return fp8_dequantize(self._read_stored(key, rows), self._read_stored(scales, rows), self.fp8_block)
        whole = fp8_dequantize(self._read_stored(key), self._read_stored(scales), self.fp8_block)
        return whole if rows is None else whole[rows[0] : rows[1]].clone()

    def _read_stored(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        try:
            if rows is not None:
                return self._handle(self.where[key]).get_slice(key)[rows[0] : rows[1]]
            return self._handle(self.where[key]).get_tensor(key)
        except ModelFileError:
            raise
        except Exception as e:
            where = os.path.join(self.model_dir, self.where[key])
            raise (
                os_limit_error(e, f"reading {key!r} from {where}")
                or ModelFileError(f"cannot read {key!r} from {self.where[key]} in {self.model_dir}: {e}")
            ) from e


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
"""Suffixes of an MXFP4-packed tensor's two parts on disk (GPT-OSS's experts): 4-bit values two to a
byte, 32 to a block, and one power-of-two scale (a biased uint8 exponent) per block."""


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bf16 tensor an MXFP4-packed one (``blocks`` [E, rows, G, 16] uint8, ``scales`` [E, rows, G])
    holds, laid out as the model's parameter ([E, G·32, rows]): ``transformers``' own dequantization
    (``convert_moe_packed_tensors``), so the import is what ``from_pretrained`` with
    ``Mxfp4Config(dequantize=True)`` loads. Every value (an FP4 value × 2^k) is exact in bf16, so
    nothing is rounded. Experts arrive one tensor (or one expert group's rows) at a time."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


FP8_SCALE = "_scale_inv"
"""Suffix of a block-scaled FP8 weight's scales on disk (DeepSeek-V3's ``weight_scale_inv``: fp32, one
per block of the weight)."""


DEQUANTIZED = ("fp8", "mxfp4")
"""``quantization_config.quant_method`` values whose weights the import dequantizes (``fp8_dequantize``,
``mxfp4_dequantize``); a checkpoint quantized otherwise is refused."""


def _check_quantization(model_dir: str) -> None:
    """Refuse a checkpoint whose ``config.json`` names a quantization the import cannot undo (GPTQ, AWQ,
    bitsandbytes, compressed-tensors' INT4 as Kimi K2.5 is published, …): its weights are not stored
    as tensors of the model's names and shapes. Raises ModelFileError naming the method and the fix."""
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        return  # no readable config here: the model's own loading says what is wrong
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method and method not in DEQUANTIZED:
        raise ModelFileError(
            f"{model_dir} is quantized with {method!r} (quantization_config in config.json); Fuyou imports "
            "full-precision checkpoints and dequantizes only block-scaled FP8 and MXFP4 ones: use the "
            "model's unquantized release, or dequantize it first (load it in transformers and save_pretrained "
            "it without its quantization_config)"
        )


def _fp8_block(model_dir: str) -> tuple[int, int]:
    """The FP8 weights' block size (``quantization_config.weight_block_size`` of ``config.json``).
    Raises ModelFileError when the checkpoint has FP8 scales but its config names no block size."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            quant = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from e
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelFileError(
            f"{model_dir} holds FP8 weights with per-block scales (*{FP8_SCALE}) but its config.json has no "
            "quantization_config.weight_block_size; add it as the model was published (e.g. [128, 128])"
        )
    return block[0], block[1]


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The fp32 tensor a block-scaled FP8 weight holds (``weight`` [..., rows, cols] float8, ``scale_inv``
    [..., ⌈rows/b₀⌉, ⌈cols/b₁⌉] fp32): each ``block`` tile, the last row and column of tiles partial,
    times its scale, in fp32. That is DeepSeek's own ``weight_dequant`` and the tile rule of
    ``transformers``' ``_dequantize_fp8_weight``; where every tile is whole it is bit for bit what
    ``from_pretrained`` with ``FineGrainedFP8Config(dequantize=True)`` loads in fp32. (That loader
    sizes tiles from the scale grid instead, which misplaces partial tiles and refuses DeepSeek-V3's
    576-row ``kv_a_proj_with_mqa``.)"""
    rows, cols = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :rows, :]
    return weight.float() * scale.repeat_interleave(block[1], dim=-1)[..., :cols]


def _conversions(model_type: str | None) -> tuple[list[tuple[str, str]], list[tuple[list[str], str]]]:
    """(on-disk, model) module-name renamings and (per-expert source patterns, fused target) merges of
    ``model_type``'s checkpoints, from ``transformers``' conversion mapping; none for other families.

    Only what ``fuyou``'s families use is taken: plain renamings, and merges that stack experts
    (``MergeModulelist`` on dim 0), then concatenate the sources along their rows (``Concatenate``
    on dim 1 of the stacked tensors)."""
    if not model_type:
        return [], []
    from transformers.conversion_mapping import WeightConverter, WeightRenaming, get_checkpoint_conversion_mapping

    renames, merges = [], []
    for conv in get_checkpoint_conversion_mapping(model_type) or []:
        if isinstance(conv, WeightConverter):
            ops = [(type(o).__name__, getattr(o, "dim", None)) for o in conv.operations or []]
            if ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]):
                merges.append(([p.lstrip(".") for p in conv.source_patterns], conv.target_patterns[0].lstrip(".")))
        elif isinstance(conv, WeightRenaming) and len(conv.source_patterns) == len(conv.target_patterns) == 1:
            disk, model = _literal(conv.source_patterns[0]), _literal(conv.target_patterns[0])
            if disk is not None and model is not None:
                renames.append((disk, model))
    return renames, merges


def _literal(pattern: str) -> str | None:
    """The text a ``transformers`` renaming pattern matches when it is a plain name with escaped dots
    (``mlp\\.router\\.gate``: Hy3's), else None (a regular expression the reverse renaming cannot undo)."""
    text = re.sub(r"\\([.\-_/])", r"\1", pattern)
    return None if re.search(r"[\\^$*+?()\[\]{}|]", text) else text


def write_shards(
    directory: str, tensors: Iterator[tuple[str, torch.Tensor]], stem: str = "model", max_shard_bytes: int = 2 << 30
) -> None:
    """Write ``(key, tensor)`` pairs into ``directory`` as safetensors shards of at most ``max_shard_bytes``
    (``{stem}-00001-of-0000N.safetensors``) and their index (``{stem}.safetensors.index.json``), holding
    at most one shard in memory."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    names: list[str] = []

    def flush() -> None:
        name = f"{stem}-{len(names) + 1:05d}.safetensors"
        save_file(shards[-1], os.path.join(directory, name), metadata={"format": "pt"})
        names.append(name)

    weight_map: dict[str, int] = {}
    for key, t in tensors:
        if size and size + t.numel() * t.element_size() > max_shard_bytes:
            flush()
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        weight_map[key] = len(names)
        size += t.numel() * t.element_size()
    flush()
    final = [f"{stem}-{i + 1:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))]
    for a, b in zip(names, final):
        os.rename(os.path.join(directory, a), os.path.join(directory, b))
    total = sum(os.path.getsize(os.path.join(directory, b)) for b in final)
    with open(os.path.join(directory, f"{stem}.safetensors.index.json"), "w") as f:
        json.dump(
            {"metadata": {"total_size": total}, "weight_map": {k: final[i] for k, i in weight_map.items()}}, f, indent=1
        )


def keep_untrained(reader: CheckpointReader, out_dir: str) -> None:
    """For a multimodal checkpoint (``reader.part``): keep in ``out_dir`` (a store's model files) what
    Fuyou does not train, for export — the checkpoint's own config, the language model's place in it
    (``multimodal.PART_FILE``) and every other tensor as stored (``UNTRAINED`` shards of ≤ 64 MiB, one tensor
    read at a time: the host holds at most a shard beside the import's own buffers). Nothing for a text-only
    checkpoint."""
    if reader.part is None:
        return
    load_config(reader.model_dir, whole=True).save_pretrained(out_dir)
    reader.part.save(out_dir)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for k in reader.untrained():
            t = reader.read_stored(k)
            reader.close()  # the shard's touched pages count as resident while it stays mapped
            yield k, t

    write_shards(out_dir, tensors(), UNTRAINED, 64 << 20)


def with_untrained(
    files: str | None, tensors: Iterator[tuple[str, torch.Tensor]], config: Any
) -> tuple[Iterator[tuple[str, torch.Tensor]], Any]:
    """The pairs and config to export: as given, or where the model files ``files`` keep a multimodal
    checkpoint's other parts (``keep_untrained``), the text model's tensors under the checkpoint's names
    followed by those parts as they were, and the checkpoint's own config."""
    if files is None or not is_multimodal_store(files):
        return tensors, config
    part = find_text_part(files, ())
    assert part is not None
    from safetensors import safe_open

    with open(os.path.join(files, f"{UNTRAINED}.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))

    def pairs() -> Iterator[tuple[str, torch.Tensor]]:
        yield from ((part.disk_key(k), t) for k, t in tensors)
        for name in shards:
            with safe_open(os.path.join(files, name), framework="pt") as f:
                for k in f.keys():
                    yield k, f.get_tensor(k)

    return pairs(), load_config(files, whole=True)


def save_streamed(
    out_dir: str,
    tensors: Iterator[tuple[str, torch.Tensor]],
    config: Any,
    dtype: torch.dtype,
    max_shard_bytes: int = 2 << 30,
    copy_from: str | None = None,
) -> None:
    """Write ``(key, tensor)`` pairs as sharded safetensors + index, the config, and tokenizer files
    (``copy_from``'s); where ``copy_from`` keeps a multimodal checkpoint's other parts, with them
    (``with_untrained``).

    ``dtype`` is recorded in the saved config. Holds at most one shard in memory. Writes into ``out_dir + '.partial'`` and renames at the end,
    so an interrupted export never looks finished.
    """
    tensors, config = with_untrained(copy_from, tensors, config)
    tmp = out_dir.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write_shards(tmp, tensors, "model", max_shard_bytes)
    config = copy.deepcopy(config)
    config.dtype = dtype  # from_pretrained then loads the weights in the dtype they were saved in
    if hasattr(config, "quantization_config"):  # imported dequantized (MXFP4, FP8): written unquantized
        del config.quantization_config
    config.save_pretrained(tmp)
    if copy_from:
        for fname in TOKENIZER_FILES:
            src = os.path.join(copy_from, fname)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(tmp, fname))
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.rename(tmp, out_dir)
