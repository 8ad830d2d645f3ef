"""Upload a bundled FAT5 folder to the Hub, after proving it loads.

The folder is checked before anything is sent: its files (config with `auto_map`, the remote code it names,
weights), that its code, weights and config are byte for byte what `fat5 bundle` wrote (the sha256 manifest; an
edited bundle is refused, naming the file, unless forced), then a fresh Python process that cannot import fat5 or
triton loads it with `trust_remote_code=True`, runs a forward and generates. Only then `create_repo(exist_ok=True)`
and `upload_folder`.
"""

import sys
from pathlib import Path

from fat5.errors import FAT5Error
from fat5.folder_contents import read_config_json

DEFAULT_COMMIT_MESSAGE = "Upload FAT5 model with `fat5 push`"
IGNORE_PATTERNS = ["**/__pycache__/**", "*.pyc", ".*"]


class PushError(FAT5Error):
    """A folder that must not be uploaded, a missing token, or a Hub that refused or could not be reached."""


def resolve_token(token: str | None = None) -> str:
    """`token`, else huggingface_hub's usual sources (HF_TOKEN, the token saved by `hf auth login`)."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise PushError(
            "no Hugging Face token: log in with `hf auth login` (or set HF_TOKEN to a token with write access)"
        )
    return token


def check_folder_files(folder: Path) -> dict:
    """The static checks of a bundle: config.json with a FAT5 model_type and an auto_map whose code files are there,
    weights in safetensors. Returns the config; raises `PushError` naming what is wrong."""
    if not folder.is_dir():
        raise PushError(f"{folder}: no such folder")
    config = read_config_json(folder, f"{folder} has no config.json: bundle a model first (`fat5 bundle MODEL_DIR "
                              "OUT`)", PushError)
    if config.get("model_type") != "fat5":
        raise PushError(f"{folder} holds a {config.get('model_type')!r} model, not a FAT5 bundle")
    auto_map = config.get("auto_map") or {}
    for required in ("AutoConfig", "AutoModel"):
        if required not in auto_map:
            raise PushError(
                f"{folder / 'config.json'} has no auto_map entry for {required}: it would not load with "
                "trust_remote_code=True (bundle it with `fat5 bundle`)"
            )
    missing_code = sorted({ref.split(".")[0] + ".py" for ref in auto_map.values()} - {p.name for p in folder.iterdir()})
    if missing_code:
        raise PushError(f"{folder} lacks the remote-code files its auto_map names: {missing_code}")
    if not any(folder.glob("*.safetensors")):
        raise PushError(f"{folder} holds no safetensors weights")
    return config


def _repo_url(endpoint: str, repo_id: str, revision: str | None) -> str:
    url = f"{endpoint.rstrip('/')}/{repo_id}"
    return f"{url}/tree/{revision}" if revision else url


def _http_error_message(error, repo_id: str) -> str:
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    hint = {
        401: "the token is invalid or expired: log in again with `hf auth login`",
        403: f"the token may not write to {repo_id} (it needs write access to that namespace)",
        404: f"{repo_id} or its revision was not found",
    }.get(status, "")
    detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return f"the Hub refused the upload to {repo_id} (HTTP {status}): {detail}" + (f"; {hint}" if hint else "")


def push(
    folder,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
    validate: bool = True,
    force: bool = False,
) -> str:
    """Upload the bundled FAT5 `folder` to the Hub model repo `repo_id` and return the repo's URL.

    The folder is validated first (files, then a load with `trust_remote_code=True`, a forward and `generate` in
    a fresh process without fat5 or triton); an invalid folder is never uploaded. The token comes from `token` or
    huggingface_hub's usual sources. The repo is created if needed (`private` applies to a new repo only);
    `revision` is a branch, created from the default branch if it does not exist. `dry_run` validates and reports
    what would be uploaded, contacting nothing. The endpoint is huggingface_hub's (`HF_ENDPOINT`). A folder whose
    code, weights or config differ from the manifest `fat5 bundle` wrote is refused unless `force` is set.
    """
    from huggingface_hub import constants

    folder = Path(folder).expanduser().absolute()
    _check_repo_id(repo_id)
    _check_bundle_files(folder, force)
    token = None if dry_run else resolve_token(token)
    if validate:
        _check_bundle_loads(folder)
    endpoint = constants.ENDPOINT
    url = _repo_url(endpoint, repo_id, revision)
    if dry_run:
        _print_upload_plan(folder, url)
        return url
    _upload(folder, repo_id, endpoint, token, private=private, revision=revision, commit_message=commit_message)
    print(f"uploaded {folder} to {url}")
    return url


def _check_repo_id(repo_id: str) -> None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"{repo_id!r} is not a valid Hub repo id: {error}") from None


def _check_bundle_files(folder: Path, force: bool) -> None:
    """The static checks, then the manifest: an edited bundle is refused, or only warned about with `force`."""
    from .bundle import manifest_differences

    check_folder_files(folder)
    differences = manifest_differences(folder)
    if differences and not force:
        raise PushError(f"refusing to upload {folder}: {'; '.join(differences)} (pass --force to push it anyway)")
    for difference in differences:
        print(f"warning: {difference} (pushed anyway: --force)", file=sys.stderr)


def _check_bundle_loads(folder: Path) -> None:
    from .bundle import BundleError, validate_bundle

    try:
        validate_bundle(folder, compare_with_package=False)
    except BundleError as error:
        raise PushError(f"refusing to upload {folder}: {error}") from None


def _print_upload_plan(folder: Path, url: str) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    size = sum(p.stat().st_size for p in files)
    print(f"dry run: would upload {len(files)} files ({size / 1e6:.1f} MB) to {url}:")
    for path in files:
        print(f"  {path.relative_to(folder)}")


def _upload(
    folder: Path, repo_id: str, endpoint: str, token: str, *, private: bool, revision: str | None, commit_message
) -> None:
    """create_repo, create_branch for a `revision`, upload_folder; every failure a `PushError` saying what to do."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
            ignore_patterns=list(IGNORE_PATTERNS),
        )
    except HfHubHTTPError as error:
        raise PushError(_http_error_message(error, repo_id)) from None
    except (OSError, ValueError, RuntimeError) as error:
        raise PushError(
            f"could not upload to the Hub at {endpoint} ({type(error).__name__}: {error}); check the network or "
            "HF_ENDPOINT"
        ) from None
    except Exception as error:  # noqa: BLE001  (the HTTP stack's own connection and timeout errors)
        raise PushError(f"could not reach the Hub at {endpoint} ({type(error).__name__}: {error})") from None
