"""Publish MoA drafters as Hugging Face Hub repos: `moa publish DRAFTER --repo-id ORG/NAME --out FOLDER [--push]`.

A repo folder holds everything `AutoModel.from_pretrained(repo_id, trust_remote_code=True)` needs without `moa_hf`:
`config.json` (with `auto_map`), the remote code (the drafter kind's `remote_code_files` in `moa_hf.drafter_types`:
`configuration_moa.py`, `modeling_moa.py` and the sibling files they import), `model.safetensors`,
`generation_config.json` and the model card `README.md` (plus the benchmark / training-info JSON the card quotes). Its
`custom_generate/` folder (`CUSTOM_GENERATE_FILES`, from `modeling/custom_generate/`) lets `target.generate(**inputs,
custom_generate=REPO, trust_remote_code=True)` decode with the drafter: `generate.py` records where to load it from
(`DRAFTER_REPO`: the Hub repo id; `DRAFTER_FOLDER`: also the folder's absolute path when it is not pushed, loaded while
it exists).

The card quotes the benchmark and training info given explicitly, else the `benchmark.json` / `training_info.json`
that `moa bench` / `moa train` left in the drafter's folder (for `default`: the shipped default drafter's folder). A
drafter serving several targets (`extra_targets`) has one benchmark per other target too: given as {name: JSON}
(`--target-benchmark NAME=JSON`), else its folder's `benchmark.NAME.json`; the repo keeps them as
`moa_benchmark.NAME.json`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from transformers import GenerationConfig, HfArgumentParser

from .drafter_types import DrafterType, drafter_type, drafter_types
from .embeddings import without_own_embeddings
from .hub_cards import load_benchmark, load_target_benchmarks, load_training_info, render_card, validate_card_metadata
from .loading import load_drafter  # re-exported: `moa_hf.hub.load_drafter` is the one loader
from .modeling import PRIMARY_TARGET, MoADrafterModel  # the type of what is published (the card reads its config)

__all__ = [
    "CUSTOM_GENERATE_FILES",
    "PublishArguments",
    "build_repo_folder",
    "card_inputs",
    "check_repo_folder",
    "drafter_folder",
    "load_drafter",
    "publish",
    "push_folder",
    "register",
    "target_benchmark_inputs",
]

BENCHMARK_FILE = "moa_benchmark.json"
TRAINING_INFO_FILE = "training_info.json"
# JSON files in a drafter's folder the card quotes when none is given (the first found): `moa bench --output` writes
# bench.json, a repo folder built by `moa publish` holds moa_benchmark.json
FOLDER_BENCHMARK_FILES = ("benchmark.json", "bench.json", BENCHMARK_FILE)
FOLDER_TRAINING_INFO_FILES = (TRAINING_INFO_FILE,)
# transformers' `custom_generate` folder, copied from modeling/custom_generate/ (generate.py's DRAFTER_* filled in)
CUSTOM_GENERATE_DIR = "custom_generate"
# the loop and its pages
_CUSTOM_GENERATE_NAMES = ("generate.py", "engine.py", "tree.py", "accept.py", "policy.py", "policy_core.py")
CUSTOM_GENERATE_FILES = tuple(f"{CUSTOM_GENERATE_DIR}/{name}" for name in _CUSTOM_GENERATE_NAMES)
_RECORDED_LINE = re.compile(r"^(DRAFTER_REPO|DRAFTER_FOLDER): str \| None = None\b.*$", re.MULTILINE)
# besides the kind's remote code (`DrafterType.remote_code_files`)
REQUIRED_FILES = ("config.json", *CUSTOM_GENERATE_FILES, "model.safetensors", "generation_config.json", "README.md")

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------------------------
# Loading the drafter
# ---------------------------------------------------------------------------------------------------------------------
def drafter_folder(spec: str | os.PathLike | MoADrafterModel) -> Path | None:
    """The folder a drafter spec loads from (`default`: the shipped default drafter's); None for a model object."""
    if isinstance(spec, (str, os.PathLike)):
        if str(spec) != "default":
            return Path(spec)
        import moa_hf

        folder = getattr(moa_hf, "default_drafter_path", None)
        return Path(folder()) if folder is not None else None
    return None


def card_inputs(
    drafter_path_or_model: str | os.PathLike | MoADrafterModel,
    benchmark: str | os.PathLike | dict | None = None,
    training_info: str | os.PathLike | dict | None = None,
) -> tuple[str | os.PathLike | dict | None, str | os.PathLike | dict | None]:
    """(benchmark, training_info) the card quotes: those given, else the JSON files found in the drafter's folder.

    The folder's `benchmark.json` (else `bench.json`, else `moa_benchmark.json`) and `training_info.json` are used only
    where the argument is None; an explicit path or dict always wins.
    """
    folder = drafter_folder(drafter_path_or_model)
    if folder is None or not folder.is_dir():
        return benchmark, training_info

    def found(names: tuple[str, ...]) -> Path | None:
        return next((folder / n for n in names if (folder / n).is_file()), None)

    return (
        benchmark if benchmark is not None else found(FOLDER_BENCHMARK_FILES),
        training_info if training_info is not None else found(FOLDER_TRAINING_INFO_FILES),
    )


def target_benchmark_inputs(
    drafter_path_or_model: str | os.PathLike | MoADrafterModel,
    target_names: list[str],
    given: dict | None = None,
) -> dict:
    """{target name: benchmark (path or dict)} the card quotes for a drafter's other targets (`target_names`): those
    `given`, else the drafter folder's `benchmark.NAME.json` (else `bench.NAME.json`) where it exists."""
    given = dict(given or {})
    folder = drafter_folder(drafter_path_or_model)
    for name in target_names:
        if name in given or folder is None:
            continue
        path = next(
            (
                folder / f"{stem}.{name}.json"
                for stem in ("benchmark", "bench")
                if (folder / f"{stem}.{name}.json").is_file()
            ),
            None,
        )
        if path is not None:
            given[name] = path
    return given


def _with_embeddings(drafter: MoADrafterModel, own_embeddings: bool) -> MoADrafterModel:
    """The drafter with (own_embeddings=True) or without its own embedding and LM head copies."""
    has_own = bool(drafter.config.own_embeddings)
    if own_embeddings == has_own:
        return drafter
    if own_embeddings:
        raise ValueError(
            "own_embeddings=True, but this drafter has no embedding and LM head of its own (it borrows the target's). "
            "Copy them first with `drafter.copy_embeddings_from(target)` and pass that drafter, or publish with "
            "own_embeddings=False."
        )
    logger.warning(
        "Publishing without the drafter's own embedding and LM head copies (it will borrow the target's); pass "
        "own_embeddings=True (--own-embeddings) to keep them."
    )
    return without_own_embeddings(drafter)


# ---------------------------------------------------------------------------------------------------------------------
# Building the repo folder
# ---------------------------------------------------------------------------------------------------------------------
def _package_file(name: str) -> bytes:
    """A file of modeling/ (`name` may be a path below it, e.g. `custom_generate/engine.py`)."""
    return resources.files("moa_hf.modeling").joinpath(*name.split("/")).read_bytes()


def _write_custom_generate(folder: Path, repo_id: str, drafter_folder: Path | None) -> None:
    """Copy `custom_generate/` into the repo folder; its generate.py records `repo_id` (DRAFTER_REPO) and the absolute
    `drafter_folder` (DRAFTER_FOLDER; None: not recorded)."""
    recorded = {"DRAFTER_REPO": repo_id, "DRAFTER_FOLDER": None if drafter_folder is None else str(drafter_folder)}
    (folder / CUSTOM_GENERATE_DIR).mkdir(exist_ok=True)
    for name in CUSTOM_GENERATE_FILES:
        data = _package_file(name)
        if name.endswith("/generate.py"):
            fill = lambda m: f"{m[1]}: str | None = {recorded[m[1]]!r}  # recorded by `moa publish`"
            text, count = _RECORDED_LINE.subn(fill, data.decode("utf-8"))
            if count != len(recorded):
                raise RuntimeError(f"modeling/{name} lacks the `{' / '.join(recorded)}: str | None = None` lines.")
            data = text.encode("utf-8")
        (folder / name).write_bytes(data)


def publishable_type(drafter) -> DrafterType:
    """The registered kind of `drafter` (a model or a config.json dict), if `moa publish` makes repos of it; else a
    ValueError naming the kinds it does publish."""
    record = drafter_type(drafter)
    if not record.publishable:
        kinds = ", ".join(f"{t.kind!r} ({t.label})" for t in drafter_types() if t.publishable)
        raise ValueError(
            f"`moa publish` makes Hub repos of the drafter kind(s) {kinds}, not of kind {record.kind!r} "
            f"({record.label}); pass a drafter of those kinds."
        )
    return record


def _complete_remote_code(folder: Path, record: DrafterType) -> None:
    """Add the remote code and `auto_map` if missing (`save_pretrained` writes them for auto-registered classes)."""
    for name in record.remote_code_files:
        if not (folder / name).is_file():  # a class that was not registered with `register_for_auto_class`
            (folder / name).write_bytes(_package_file(name))
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    architectures = [record.model_class.__name__]
    if config.get("auto_map") != record.auto_map or config.get("architectures") != architectures:
        config["auto_map"] = record.auto_map
        config["architectures"] = architectures
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if not (folder / "generation_config.json").is_file():
        record.model_class.default_generation_config(GenerationConfig()).save_pretrained(folder)


def _prepare_out_dir(out_dir: Path, source: Path | None, overwrite: bool) -> None:
    if source is not None and source.resolve() == out_dir.resolve():
        raise ValueError(f"--out {out_dir} is the drafter's own folder; choose another output folder.")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        config = out_dir / "config.json"
        auto_map = config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("auto_map")
        is_build = any(auto_map == t.auto_map for t in drafter_types() if t.publishable)
        if not overwrite:
            raise FileExistsError(
                f"{out_dir} already exists and is not empty. Choose another folder, or pass overwrite=True "
                "(--overwrite) to replace an earlier repo folder."
            )
        if not is_build:
            raise FileExistsError(
                f"{out_dir} is not empty and does not look like a drafter repo folder built by `moa publish`; "
                "refusing to replace it. Choose another output folder."
            )


def build_repo_folder(
    drafter_path_or_model: str | os.PathLike | MoADrafterModel,
    repo_id: str,
    out_dir: str | os.PathLike,
    benchmark: str | os.PathLike | dict | None = None,
    training_info: str | os.PathLike | dict | None = None,
    own_embeddings: bool = False,
    *,
    base_model: str | None = None,
    license: str = "apache-2.0",
    overwrite: bool = False,
    record_folder: bool = True,
    target_benchmarks: dict | None = None,
) -> Path:
    """Write the complete Hub repo folder of a drafter to `out_dir` and return it.

    `benchmark` / `training_info` (path or dict) default to the JSON files in the drafter's folder (see `card_inputs`).
    `own_embeddings=False` publishes the drafter without embedding/LM-head copies (they are borrowed from the target
    on `attach`); True keeps the drafter's own copies (it must have them). `base_model` defaults to the target the
    drafter records (`config.target_name_or_path`). The repo's `custom_generate/generate.py` loads the drafter from
    `repo_id` when the caller passes no `drafter=`, or from the absolute path of `out_dir` while it exists when
    `record_folder` (`publish(push=True)` passes False: no local path in a public repo). `target_benchmarks`: {target
    name: path or dict} of a multi-target drafter's other targets (see `target_benchmark_inputs`).
    """
    out_dir = Path(out_dir)
    is_path = isinstance(drafter_path_or_model, (str, os.PathLike)) and str(drafter_path_or_model) != "default"
    source = Path(drafter_path_or_model) if is_path else None
    _prepare_out_dir(out_dir, source, overwrite)
    drafter = load_drafter(drafter_path_or_model)
    record = publishable_type(drafter)
    drafter = _with_embeddings(drafter, own_embeddings)
    benchmark, training_info = card_inputs(drafter_path_or_model, benchmark, training_info)
    bench = load_benchmark(benchmark)
    info = load_training_info(training_info)
    others = [name for name in getattr(drafter, "target_names", ()) if name != PRIMARY_TARGET]
    per_target = load_target_benchmarks(target_benchmark_inputs(drafter_path_or_model, others, target_benchmarks))
    card = render_card(  # fails early
        drafter, bench, info, repo_id=repo_id, base_model=base_model, license=license, target_benchmarks=per_target
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))  # renamed into place when complete
    try:
        drafter.save_pretrained(tmp)
        _complete_remote_code(tmp, record)
        _write_custom_generate(tmp, repo_id, out_dir.resolve() if record_folder else None)
        card.save(tmp / "README.md")
        if bench is not None:
            (tmp / BENCHMARK_FILE).write_text(json.dumps(bench, indent=2) + "\n", encoding="utf-8")
        for name, measured in per_target.items():
            (tmp / _target_file(BENCHMARK_FILE, name)).write_text(
                json.dumps(measured, indent=2) + "\n", encoding="utf-8"
            )
        if info is not None:
            (tmp / TRAINING_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        check_repo_folder(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _target_file(file_name: str, target: str) -> str:
    """`moa_benchmark.json` -> `moa_benchmark.TARGET.json`: the file of one of a drafter's other targets."""
    stem, _, suffix = file_name.rpartition(".")
    return f"{stem}.{target}.{suffix}"


def check_repo_folder(folder: str | os.PathLike) -> list[str]:
    """Check that a repo folder is complete (files, `auto_map`, card metadata); returns the names in it."""
    folder = Path(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else None
    try:
        record = None if config is None else publishable_type(config)
    except ValueError as err:
        raise ValueError(f"{config_path} (model_type {config.get('model_type')!r}): {err}") from err
    needed = (*REQUIRED_FILES, *(record.remote_code_files if record else ()))
    missing = [name for name in needed if not (folder / name).is_file()]
    if missing:
        raise ValueError(f"The repo folder {folder} lacks {missing}; rebuild it with `moa publish`.")
    if config.get("auto_map") != record.auto_map:
        raise ValueError(f"{config_path} has auto_map {config.get('auto_map')}, expected {record.auto_map}.")
    validate_card_metadata((folder / "README.md").read_text(encoding="utf-8"))
    return sorted(p.name for p in folder.iterdir())


# ---------------------------------------------------------------------------------------------------------------------
# Uploading
# ---------------------------------------------------------------------------------------------------------------------
def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection errors of the HTTP clients huggingface_hub may use (requests' are OSErrors already)."""
    errors: list[type[BaseException]] = [OSError]
    for module in ("httpx", "httpx2"):
        if importlib.util.find_spec(module) is not None:
            errors.append(importlib.import_module(module).TransportError)
    return tuple(errors)


_LOGIN_HINT = "Log in with `hf auth login`, set the HF_TOKEN environment variable, or pass --token (token=...)"


def push_folder(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
) -> str:
    """Upload a repo folder to the Hub (creating the repo and branch if needed); returns the commit URL.

    Raises `RuntimeError` with what to do when offline, unauthenticated or refused by the Hub.
    """
    from huggingface_hub import constants, create_branch, create_repo, get_token, upload_folder
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

    where = f"The repo folder is ready at {folder}; upload it later with `hf upload {repo_id} {folder}`."
    offline = (
        f"Cannot upload to the Hugging Face Hub: {{}}. Unset HF_HUB_OFFLINE and check that huggingface.co "
        f"({constants.ENDPOINT}) can be reached. {where}"
    )
    if constants.HF_HUB_OFFLINE:
        raise RuntimeError(offline.format("offline mode is enabled (HF_HUB_OFFLINE=1)"))
    token = token or get_token()
    if not token:
        raise RuntimeError(f"Cannot upload to the Hugging Face Hub: not authenticated. {_LOGIN_HINT}. {where}")
    try:
        create_repo(repo_id, token=token, private=private, exist_ok=True)
        if revision and revision != constants.DEFAULT_REVISION:
            create_branch(repo_id, branch=revision, token=token, exist_ok=True)
        info = upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            revision=revision,
            commit_message=commit_message or "Upload MoA drafter with moa-hf",
            token=token,
        )
    except OfflineModeIsEnabled as err:
        raise RuntimeError(offline.format("offline mode is enabled (HF_HUB_OFFLINE=1)")) from err
    except LocalTokenNotFoundError as err:
        raise RuntimeError(
            f"Cannot upload to the Hugging Face Hub: not authenticated. {_LOGIN_HINT}. {where}"
        ) from err
    except HfHubHTTPError as err:
        status = getattr(getattr(err, "response", None), "status_code", None)
        if status in (401, 403):
            raise RuntimeError(
                f"The Hugging Face Hub refused the upload to {repo_id} (HTTP {status}): not authenticated, or the "
                f"token may not write to this namespace. {_LOGIN_HINT} with a token that has write access. {where}"
            ) from err
        raise RuntimeError(f"The Hugging Face Hub refused the upload to {repo_id}: {err}. {where}") from err
    except _network_errors() as err:
        raise RuntimeError(offline.format(f"no connection ({type(err).__name__}: {err})")) from err
    return str(getattr(info, "commit_url", info))


def publish(
    drafter_path_or_model: str | os.PathLike | MoADrafterModel,
    repo_id: str,
    out_dir: str | os.PathLike,
    *,
    benchmark: str | os.PathLike | dict | None = None,
    training_info: str | os.PathLike | dict | None = None,
    own_embeddings: bool = False,
    base_model: str | None = None,
    license: str = "apache-2.0",
    overwrite: bool = False,
    push: bool = False,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    target_benchmarks: dict | None = None,
) -> Path | str:
    """Build the repo folder; with `push=True` also upload it. Returns the folder, or the commit URL when pushed."""
    folder = build_repo_folder(
        drafter_path_or_model,
        repo_id,
        out_dir,
        benchmark=benchmark,
        training_info=training_info,
        own_embeddings=own_embeddings,
        base_model=base_model,
        license=license,
        overwrite=overwrite,
        record_folder=not push,  # an unpushed folder's generate.py loads the folder itself while it exists
        target_benchmarks=target_benchmarks,
    )
    if not push:
        return folder
    return push_folder(folder, repo_id, private=private, revision=revision, commit_message=commit_message, token=token)


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------
def _target_benchmark_args(values: list[str] | None) -> dict[str, str]:
    """{target name: JSON path} of `--target-benchmark NAME=JSON` (given once per target)."""
    pairs = {}
    for text in values or ():
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"--target-benchmark {text!r}: expected NAME=JSON, e.g. pydoc=runs/bench_pydoc/bench.json."
            )
        pairs[name] = path
    return pairs


@dataclass
class PublishArguments:
    """`moa publish DRAFTER`'s options (the positional DRAFTER, a folder or `default`, is no option: argparse's)."""

    repo_id: str = field(metadata={"metavar": "ORG/NAME", "help": "the Hub repo id"})
    out: str = field(metadata={"metavar": "FOLDER", "help": "where to write the repo folder"})
    benchmark: str | None = field(
        default=None,
        metadata={
            "metavar": "JSON",
            "help": "benchmark JSON from `moa bench` (speed numbers of the card; default: DRAFTER/benchmark.json if "
            "present)",
        },
    )
    target_benchmark: list[str] | None = field(
        default=None,
        metadata={
            "action": "extend",
            "metavar": "NAME=JSON",
            "help": "a multi-target drafter: the `moa bench` JSON measured with its target NAME (once per other "
            "target; default: DRAFTER/benchmark.NAME.json if present)",
        },
    )
    training_info: str | None = field(
        default=None,
        metadata={
            "metavar": "JSON",
            "help": "training info JSON from `moa train` (data, tokens, wall time, learning curve...; default: "
            "DRAFTER/training_info.json if present)",
        },
    )
    own_embeddings: bool = field(default=False, metadata={"help": "keep the drafter's own embedding/LM head copies"})
    base_model: str | None = field(
        default=None,
        metadata={"metavar": "ORG/NAME", "help": "Hub id of the target (default: the one the drafter records)"},
    )
    license: str = field(default="apache-2.0", metadata={"help": "Hub license id of the card (default: apache-2.0)"})
    overwrite: bool = field(default=False, metadata={"help": "replace an earlier repo folder at --out"})
    push: bool = field(default=False, metadata={"help": "upload the folder to the Hub"})
    private: bool = field(default=False, metadata={"help": "create the repo as private (with --push)"})
    revision: str | None = field(
        default=None, metadata={"help": "branch to upload to (created if needed; default: main)"}
    )
    commit_message: str | None = field(default=None, metadata={"help": "commit message of the upload"})
    token: str | None = field(
        default=None, metadata={"help": "Hub token (default: HF_TOKEN or the token saved by `hf auth login`)"}
    )


def _run(namespace: argparse.Namespace) -> int:
    (args,) = HfArgumentParser(PublishArguments).parse_dict(vars(namespace), allow_extra_keys=True)
    try:
        options = asdict(args)
        target_benchmarks = _target_benchmark_args(options.pop("target_benchmark"))
        bench, info = card_inputs(namespace.drafter, options.pop("benchmark"), options.pop("training_info"))
        result = publish(
            namespace.drafter,
            options.pop("repo_id"),
            options.pop("out"),
            benchmark=bench,
            training_info=info,
            target_benchmarks=target_benchmarks,
            **options,
        )
    except (RuntimeError, ValueError, FileNotFoundError, FileExistsError) as err:
        raise SystemExit(f"moa publish: error: {err}") from err
    for what, source in (("benchmark", bench), ("training info", info)):
        print(f"Model card: {what} from {source}" if source is not None else f"Model card: no {what} (none found)")
    if args.push:
        print(f"Uploaded {args.repo_id}: {result}")
    else:
        print(f"Repo folder for {args.repo_id} written to {result}. Upload it with --push (or `hf upload`).")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `moa publish` (its options: the fields of `PublishArguments`, after the positional DRAFTER)."""
    p = subparsers.add_parser(
        "publish",
        parents=[HfArgumentParser(PublishArguments, add_help=False)],
        help="build (and upload) a Hugging Face Hub repo for a drafter",
        description="Build a Hub repo folder for a MoA drafter (weights, remote code, config, model card) and "
        "optionally upload it. The card quotes --benchmark and --training-info; without them it uses the "
        "benchmark.json (a `moa bench` result) and training_info.json (written by `moa train`) found in the "
        "DRAFTER folder -- for `default`, the shipped default drafter's folder -- when they exist. Options: the "
        "fields of PublishArguments, each spelled with hyphens or underscores.",
    )
    p.add_argument("drafter", metavar="DRAFTER", help="a saved drafter folder, or `default`")
    p.set_defaults(func=_run)
