"""Loading checkpoints with their FarSkip connectivity applied."""

from __future__ import annotations

from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate through it

from fcsd.connectivity.patch import CONFIG_KEY, apply_farskip

CONFIG_ERRORS = (ValueError, TypeError, KeyError, StrictDataclassError)  # garbage, mistyped or inconsistent values


def from_pretrained(
    name_or_path: str, layers=None, text_only: bool = False, model_class=None, keep_fp8: bool = False, **kwargs
):
    """Load a causal LM (hub id or local folder) and apply FarSkip connectivity. Every fcsd command loads models
    through here (training, evaluation, export, the demo), so an exported ``farskip_*`` folder works everywhere.

    The class is the checkpoint's own architecture when transformers has it (so a multimodal Llama-4 checkpoint
    stays ``Llama4ForConditionalGeneration`` instead of losing its vision tower), else ``AutoModelForCausalLM``;
    ``text_only`` always takes ``AutoModelForCausalLM`` (the text tower of a multimodal checkpoint: what FCSD trains).

    ``layers`` overrides the selection; by default the layers recorded in the checkpoint's ``config.farskip`` are
    converted (none for a stock checkpoint). An exported folder (model type ``farskip_<stock type>``) loads through
    the stock transformers classes, without its remote code. ``model_class`` overrides the class (expert
    parallelism's sharded loader passes one). ``kwargs`` go to ``from_pretrained`` (``dtype``, ``device_map``, ...).

    A block-FP8 checkpoint (design §8) is dequantized by fcsd as it is read (:mod:`fcsd.block_fp8`), into ``dtype``;
    ``keep_fp8`` keeps transformers' FP8 modules instead (a CUDA GPU of compute capability >= 8.9 only).
    """
    config = _stock_config(name_or_path, kwargs.get("revision"))
    if config is not None:
        kwargs.setdefault("config", config)
    checked = check_quantization(
        config if config is not None else load_config(name_or_path, kwargs.get("revision")), name_or_path
    )
    check_weight_files(name_or_path)

    from fcsd.block_fp8 import check_fp8_modules, dequantizing_class, fp8_settings, without_quantization

    settings = fp8_settings(checked)
    if keep_fp8:
        check_fp8_modules(settings, name_or_path)
    sharded = model_class is not None  # a sharded loader (expert parallelism) reads only its own part of the weights
    if model_class is None:
        model_class = model_class_for(name_or_path, text_only, config, kwargs.get("revision"))
    loader = model_class
    if settings is not None and not keep_fp8:
        kwargs["config"] = without_quantization(kwargs.get("config") or checked)
        model_class = _concrete(model_class, kwargs["config"])
        loader = dequantizing_class(model_class, settings)
    if kwargs.get("config") is not None:  # a concrete text class (FP8, a sharded loader) gets the text config
        kwargs["config"] = _config_for(model_class, kwargs["config"])
    if sharded:
        model = loader.from_pretrained(name_or_path, **kwargs)
    else:
        model, info = loader.from_pretrained(name_or_path, output_loading_info=True, **kwargs)
        check_no_missing_weights(name_or_path, info.get("missing_keys") or [])
    if type(model) is not model_class and type(model) is loader:
        model.__class__ = model_class  # the class it would have had (the exported remote code names its module)
    if layers is None:
        record = getattr(model.config, CONFIG_KEY, None) or {}
        layers = record.get("layers", [])
    return apply_farskip(model, layers)


def check_no_missing_weights(name_or_path: str, missing) -> None:
    """Refuse a checkpoint whose weight files lack weights its ``config.json`` asks for: transformers would start
    them from random values with only a load report in the log (an edited config, a partial copy), and a teacher or a
    converted model would silently be another model."""
    missing = sorted(missing)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ValueError(
            f"{name_or_path}: {len(missing)} weights its config.json asks for are not in its weight files ({shown}), "
            "so they would start from random values: config.json and the weights disagree (an edited config or an "
            "incomplete copy); restore the checkpoint's own config.json or copy the weights again"
        )


def check_weight_files(folder: str) -> None:
    """Refuse, naming the file, a local ``.safetensors`` file that is truncated or corrupt (an interrupted copy or
    download), before transformers reads it and fails without saying which file."""
    from pathlib import Path

    from fcsd.weight_files import read_header

    for path in sorted(Path(folder).glob("*.safetensors")) if Path(folder).is_dir() else []:
        size = path.stat().st_size
        try:
            start, header = read_header(path) if size >= 8 else (None, None)
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, AttributeError):
            start = end = None
        if start is None or size < start + end:
            raise ValueError(
                f"{path} is truncated or corrupt ({size:,} bytes, its header "
                + ("cannot be read" if start is None else f"needs {start + end:,}")
                + "): download or copy it again"
            )


def model_class_for(name_or_path: str, text_only: bool = False, config=None, revision: str | None = None):
    """The class :func:`from_pretrained` loads ``name_or_path`` with (an auto class or a multimodal one)."""
    import transformers

    if text_only:
        return transformers.AutoModelForCausalLM
    return _model_class(name_or_path, config, revision)


def _concrete(model_class: type, config) -> type:
    """``model_class`` with an auto class resolved to the class it picks for ``config``."""
    from transformers.models.auto.auto_factory import _BaseAutoModelClass, _get_model_class

    return (
        _get_model_class(config, model_class._model_mapping)
        if issubclass(model_class, _BaseAutoModelClass)
        else model_class
    )


def _config_for(model_class: type, config):
    """The (sub-)config ``model_class`` is built from: a composite's text config for its text tower, as transformers'
    auto classes pick it (a text class built from the composite's config fails: ``Llama4Config`` has no
    ``pad_token_id``)."""
    wanted = getattr(model_class, "config_class", None)  # None: an auto class, which picks it itself
    text = config.get_text_config()
    if wanted is None or text is config or isinstance(config, wanted) or not isinstance(text, wanted):
        return config
    return text


def tokenizer_from_pretrained(name_or_path: str, revision: str | None = None):
    """The tokenizer of a checkpoint (at ``revision`` of a hub repo); for an exported FarSkip folder or hub repo
    without asking to run its remote code (the tokenizer is a stock one: only the model type is new)."""
    from transformers import AutoTokenizer

    check_tokenizer_files(name_or_path)
    config = _stock_config(name_or_path, revision)
    options = {"config": config} if config is not None else {}
    return AutoTokenizer.from_pretrained(name_or_path, revision=revision, **options)


def check_tokenizer_files(name_or_path: str) -> None:
    """Refuse a local checkpoint folder without any tokenizer file: transformers would build a stand-in tokenizer
    from the config, and every token count, loss and score after it would be wrong without a word."""
    from pathlib import Path

    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{name_or_path} holds no tokenizer ({', '.join(TOKENIZER_FILES[:2])}, ...): copy the tokenizer files "
            "saved with the checkpoint into it"
        )


#: the files a tokenizer is saved as (fast, sentencepiece, BPE vocabularies, tiktoken)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "tokenizer.tiktoken",
)


def check_tokenizer_fits(tokenizer, config, name: str) -> None:
    """Refuse a tokenizer with more tokens than the model (``config``) predicts: its extra ids would index past the
    embedding. Every command that tokenises for a model checks it before loading the weights."""
    from fcsd.connectivity.families import text_config

    vocab = getattr(text_config(config), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"vocabulary mismatch: the tokenizer has {len(tokenizer)} tokens but {name} predicts only {vocab}; use "
            "the tokenizer saved with the checkpoint"
        )


def load_config(name_or_path: str, revision: str | None = None):
    """The transformers config of a checkpoint (an export's as its stock type; a hub repo at ``revision``), with an
    unreadable config.json as a one-line error."""
    from pathlib import Path

    from transformers import AutoConfig

    folder = Path(name_or_path).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        from fcsd.files.run_folder import RunFolder

        run = RunFolder(folder)
        inside = run.checkpoint()  # a run folder: its export/, best/ or final/
        if inside is not None:
            fix = f"it is an fcsd run folder; give {inside}"
        elif run.checkpoints():
            newest = run.checkpoints()[-1]
            fix = f"it is an fcsd run folder without final/; export a step checkpoint: `fcsd export {newest} OUT_DIR`"
        else:
            fix = "give a checkpoint folder"
        raise ValueError(f"{name_or_path} has no config.json, so it is no checkpoint; {fix}")
    stock = _stock_config(name_or_path, revision)  # its own errors are one line already (JSON, identity, hub)
    if stock is not None:
        return check_quantization(stock, name_or_path)
    try:
        config = AutoConfig.from_pretrained(name_or_path, revision=revision)
    except CONFIG_ERRORS as error:  # garbage, mistyped or inconsistent values
        raise ValueError(f"{name_or_path}: config.json cannot be read ({config_error_text(error)})") from None
    return check_quantization(config, name_or_path)


#: quantization methods fcsd loads: block FP8 (DeepSeek-V3, the Qwen3 -FP8 releases), which transformers dequantizes
#: where no FP8 kernel runs (design §8)
QUANTIZATION_METHODS = ("fp8",)


def check_quantization(config, name: str):
    """Refuse, in one line, a checkpoint quantized with a method fcsd cannot train from (bitsandbytes, GPTQ, AWQ,
    compressed-tensors, ...): FCSD trains fp32 master weights and its teacher must compute what the source computes.
    Returns ``config``."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return config
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method not in QUANTIZATION_METHODS:
        raise ValueError(
            f"{name} is quantized with {method} (quantization_config.quant_method): fcsd loads unquantized (bf16 / "
            "fp32) or block-FP8 checkpoints; start from the unquantized release of the model, or dequantize it "
            "and save_pretrained the result"
        )
    return config


def config_error_text(error: Exception) -> str:
    """The first line of what a config's validation said: for huggingface_hub's strict-dataclass errors (whose first
    line only names the validator, e.g. a ``text_config`` whose ``num_hidden_layers`` disagrees with its
    ``layer_types``), the cause's."""
    cause = error.__cause__ if error.__cause__ is not None else error
    lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
    return (lines[0] if lines else type(cause).__name__)[:160]


def _stock_config(name_or_path: str, revision: str | None = None):
    """The stock transformers config of an exported FarSkip folder or hub repo, or None for anything else. Every
    config fcsd loads passes here first: its FarSkip fields must agree (:func:`fcsd.serving.identity.identify`), so that
    a damaged export is refused in one line instead of loading with stock wiring."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    from fcsd.connectivity.families import base_model_type
    from fcsd.serving.identity import identify_folder

    path = Path(name_or_path) / "config.json"
    if not path.exists():
        path = hub_config_file(name_or_path, revision)
    if path is None:
        return None
    try:
        values = json.loads(path.read_text())
    except ValueError as error:
        raise ValueError(f"{path} cannot be read as JSON ({str(error)[:120]}): copy or download it again") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} holds a JSON {type(values).__name__}, not an object")
    if identify_folder(path.parent, values, str(path)) != "export":
        return None
    for key in ("auto_map", "architectures"):
        values.pop(key, None)
    base_type = base_model_type(values.pop("model_type"))
    values["architectures"] = values.get(CONFIG_KEY, {}).get("base_architectures")
    try:
        return AutoConfig.for_model(base_type, **values)
    except CONFIG_ERRORS as error:  # a mistyped or inconsistent value of the stock config's
        raise ValueError(f"{path} cannot be read ({config_error_text(error)})") from None


def hub_config_file(name: str, revision: str | None = None):
    """``config.json`` of hub repo ``name`` (downloaded once into the hub cache), None for a local path."""
    from pathlib import Path

    from fcsd.sources import looks_local

    if looks_local(name) or Path(name).exists() or name.count("/") > 1:
        return None
    from huggingface_hub import hf_hub_download

    from fcsd.sources import SourceError, explain_error

    try:
        return Path(hf_hub_download(name, "config.json", revision=revision))
    except Exception as error:  # the first hub access of any command: say which repo, in one line
        message = explain_error(error, repo=name)
        if message is None:
            raise
        raise SourceError(message) from None


def _model_class(name_or_path: str, config=None, revision: str | None = None):
    import transformers

    if config is None:
        try:
            config = transformers.AutoConfig.from_pretrained(name_or_path, revision=revision)
        except (OSError, ValueError):  # let AutoModelForCausalLM report the problem
            return transformers.AutoModelForCausalLM
    architectures = getattr(config, "architectures", None) or []
    named = getattr(transformers, architectures[0], None) if architectures else None
    return (
        named
        if isinstance(named, type) and named.__name__.endswith("ForConditionalGeneration")
        else (transformers.AutoModelForCausalLM)
    )
