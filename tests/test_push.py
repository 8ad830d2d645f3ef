"""`fat5 push` through huggingface_hub's real client against a local HTTP server standing in for the Hub.

The server records every request; tests assert what was asked (repo creation, preupload, the commit and the bytes of
every file) and that nothing at all is sent for an invalid folder or without a token.
"""

import base64
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from helpers import make_checkpoint

from fat5.commands.convert import convert_to_hub_folder
from fat5.conversion import convert
from fat5.hub_upload import PushError, bundle, push
from fat5_command import build_parser

push_module = sys.modules["fat5.hub_upload.push"]


class FakeHub:
    """Answers the endpoints `create_repo`, `create_branch` and `upload_folder` use (files are all declared
    "regular", so their bytes travel inside the commit), and file downloads as the Hub does for a repo it holds no
    file of; `failures` maps a path fragment to an HTTP status to answer instead."""

    def __init__(self):
        self.requests = []
        self.failures: dict[str, int] = {}
        self.created: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status, payload, headers=()):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for key, value in headers:
                    self.send_header(key, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self):
                path = urlsplit(self.path).path
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if path == "/api/agent-harnesses":  # huggingface_hub's user-agent registry, not about any repo
                    return self._answer(200, {"standardEnvVars": [], "harnesses": {}})
                hub.requests.append(
                    {"method": self.command, "path": path, "auth": self.headers.get("Authorization"), "body": body}
                )
                for fragment, status in hub.failures.items():
                    if fragment in path:
                        return self._answer(status, {"error": f"fake hub says {status}"})
                if path == "/api/repos/create":
                    request = json.loads(body)
                    hub.created.add(f"{request['organization']}/{request['name']}")
                    return self._answer(200, {"url": f"{hub.url}/{request['organization']}/{request['name']}"})
                if path == "/api/validate-yaml":  # upload_folder checks the README's metadata first
                    return self._answer(200, {"errors": [], "warnings": []})
                if "/preupload/" in path:
                    files = json.loads(body)["files"]
                    return self._answer(
                        200,
                        {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]},
                    )
                if "/commit/" in path:
                    repo = path.split("/commit/")[0].removeprefix("/api/models/")
                    oid = "0123456789abcdef0123456789abcdef01234567"
                    return self._answer(200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid})
                if "/branch/" in path:
                    return self._answer(200, {})
                if "/resolve/" in path and path.split("/resolve/")[0].strip("/") in hub.created:
                    # transformers' push_to_hub reads the new repo's model card first (there is none yet)
                    return self._answer(404, {"error": "Entry not found"}, [("X-Error-Code", "EntryNotFound")])
                return self._answer(404, {"error": "Repository not found"}, [("X-Error-Code", "RepoNotFound")])

            do_GET = do_HEAD = do_POST = do_PUT = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def commits(self):
        """The ndjson commits received, each as (header, {path: bytes})."""
        commits = []
        for request in self.requests:
            if "/commit/" in request["path"]:
                lines = [json.loads(line) for line in request["body"].splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                files = {
                    line["value"]["path"]: base64.b64decode(line["value"]["content"])
                    for line in lines
                    if line["key"] == "file"
                }
                commits.append((header, files))
        return commits


@pytest.fixture
def hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    fake = FakeHub()
    fake.thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", fake.url)
    # file downloads build their address from this template, made from the real endpoint at import: without it they
    # would go to huggingface.co, which a machine without internet retries with backoff for 24 s
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token-file"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.delenv("HF_OIDC_RESOURCE", raising=False)
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A converted (not bundled) folder and its bundle (the bundle's own load check skipped: push does one)."""
    root = tmp_path_factory.mktemp("push")
    source = make_checkpoint(root / "src", "t5")
    convert(source, root / "converted")
    bundle(root / "converted", root / "bundle", validate=False)
    return root / "converted", root / "bundle"


def _bundle_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_push_validates_then_uploads_every_file(hub, folders, capsys):
    _, bundled = folders
    url = push(bundled, "someone/fat5-tiny", private=True, commit_message="first upload")
    assert url == f"{hub.url}/someone/fat5-tiny"
    assert url in capsys.readouterr().out
    create = [r for r in hub.requests if r["path"] == "/api/repos/create"]
    assert len(create) == 1 and create[0]["auth"] == "Bearer hf_test_token"
    assert json.loads(create[0]["body"]) == {
        "name": "fat5-tiny",
        "organization": "someone",
        "visibility": "private",
        "type": "model",
    }
    assert any(r["path"] == "/api/models/someone/fat5-tiny/preupload/main" for r in hub.requests)
    [(header, files)] = hub.commits()
    assert header["summary"] == "first upload"
    assert files == _bundle_files(bundled)
    assert {"config.json", "modeling_fat5.py", "model.safetensors", "README.md"} <= set(files)


def test_push_to_a_branch(hub, folders):
    _, bundled = folders
    url = push(bundled, "someone/fat5-tiny", revision="dev", validate=False)
    assert url == f"{hub.url}/someone/fat5-tiny/tree/dev"
    paths = [r["path"] for r in hub.requests]
    assert "/api/models/someone/fat5-tiny/branch/dev" in paths
    assert "/api/models/someone/fat5-tiny/commit/dev" in paths


def _copy_of(source: Path, folder: Path) -> Path:
    folder.mkdir()
    for name, content in _bundle_files(source).items():
        (folder / name).write_bytes(content)
    return folder


def test_invalid_folders_are_never_uploaded(hub, folders, tmp_path):
    converted, bundled = folders
    # a converted folder loads as remote code (every FAT5 save writes its code) but `fat5 bundle` did not check it
    with pytest.raises(PushError, match="has no fat5_manifest.json"):
        push(converted, "someone/fat5-tiny")
    without_auto_map = _copy_of(converted, tmp_path / "without_auto_map")
    config = json.loads((converted / "config.json").read_text())
    del config["auto_map"]
    (without_auto_map / "config.json").write_text(json.dumps(config))
    with pytest.raises(PushError, match="no auto_map entry for AutoConfig"):
        push(without_auto_map, "someone/fat5-tiny")
    broken = _copy_of(bundled, tmp_path / "broken")
    (broken / "modeling_fat5.py").write_text("raise RuntimeError('deliberately broken')\n")
    with pytest.raises(PushError, match="refusing to upload .*RuntimeError: deliberately broken$"):
        push(broken, "someone/fat5-tiny", force=True)  # one line: the clean process's exception, not its traceback
    weights = _bundle_files(bundled)["model.safetensors"]
    (broken / "modeling_fat5.py").write_bytes(_bundle_files(bundled)["modeling_fat5.py"])
    (broken / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(PushError, match="refusing to upload .*model.safetensors is not a readable safetensors file "
                                        r"\(truncated or corrupted\?\): .*header[^\n]*$"):
        push(broken, "someone/fat5-tiny", force=True)
    (broken / "modeling_fat5.py").unlink()
    with pytest.raises(PushError, match=r"lacks the remote-code files its auto_map names: \['modeling_fat5.py'\]"):
        push(broken, "someone/fat5-tiny")
    with pytest.raises(PushError, match="no such folder"):
        push(tmp_path / "nothing", "someone/fat5-tiny")
    with pytest.raises(PushError, match="not a valid Hub repo id"):
        push(bundled, "not a//repo id")
    assert hub.requests == []


@pytest.mark.parametrize("edit, named", [
    ("code", "rms_norm.py differs from what `fat5 bundle` wrote"),
    ("weights", "model.safetensors differs"),
    ("config", "config.json differs"),
    ("added code", "extra.py was added after `fat5 bundle`"),
    ("removed manifest", "has no fat5_manifest.json"),
])
def test_an_edited_bundle_is_refused_naming_the_file(hub, folders, tmp_path, edit, named, capsys):
    """A bundle whose code computes something else (and loads fine) is refused, dry run or not; --force pushes it."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, bundled = folders
    edited = Path(shutil.copytree(bundled, tmp_path / "edited"))
    if edit == "code":
        code = (edited / "rms_norm.py").read_text()
        assert "\n    return " in code
        (edited / "rms_norm.py").write_text(code.replace("\n    return ", "\n    return 0 * ", 1))
    elif edit == "weights":
        tensors = load_file(edited / "model.safetensors")
        name = min(tensors)
        tensors[name] = tensors[name] * 0
        save_file(tensors, edited / "model.safetensors", metadata={"format": "pt"})
    elif edit == "config":
        config = json.loads((edited / "config.json").read_text())
        (edited / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 0.5}))
    elif edit == "added code":
        (edited / "extra.py").write_text("VALUE = 1\n")
    else:
        (edited / "fat5_manifest.json").unlink()
    (edited / "README.md").write_text("an edited model card is fine\n")
    for dry_run in (True, False):
        with pytest.raises(PushError, match=f"refusing to upload .*{named}.*--force"):
            push(edited, "someone/fat5-tiny", dry_run=dry_run, validate=False)
    assert hub.requests == []
    push(edited, "someone/fat5-tiny", validate=False, force=True)
    assert "pushed anyway" in capsys.readouterr().err
    [(_, files)] = hub.commits()
    assert files == _bundle_files(edited)


def test_an_untouched_bundle_matches_its_manifest(folders):
    from fat5.hub_upload.bundle import manifest_differences

    _, bundled = folders
    manifest = json.loads((bundled / "fat5_manifest.json").read_text())["sha256"]
    assert {"config.json", "model.safetensors", "modeling_fat5.py", "rms_norm.py"} <= set(manifest)
    assert "README.md" not in manifest and manifest_differences(bundled) == []


def test_missing_token(hub, folders, monkeypatch):
    _, bundled = folders
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(PushError, match="no Hugging Face token: log in with `hf auth login`"):
        push(bundled, "someone/fat5-tiny", validate=False)
    assert hub.requests == []


def test_dry_run_sends_nothing(hub, folders, monkeypatch, capsys):
    _, bundled = folders
    monkeypatch.delenv("HF_TOKEN")  # a dry run needs no token either
    url = push(bundled, "someone/fat5-tiny", dry_run=True, validate=False)
    printed = capsys.readouterr().out
    assert url == f"{hub.url}/someone/fat5-tiny" and "dry run" in printed and "modeling_fat5.py" in printed
    assert hub.requests == []


@pytest.mark.parametrize(
    "fragment, status, message",
    [
        ("/api/repos/create", 403, r"HTTP 403.*may not write to someone/fat5-tiny"),
        ("/api/repos/create", 401, r"HTTP 401.*invalid or expired"),
        ("/preupload/", 404, r"HTTP 404"),
    ],
)
def test_http_errors_are_clear(hub, folders, fragment, status, message):
    _, bundled = folders
    hub.failures[fragment] = status
    with pytest.raises(PushError, match=message):
        push(bundled, "someone/fat5-tiny", validate=False)
    assert hub.commits() == []


def test_unreachable_hub(hub, folders, monkeypatch):
    from huggingface_hub import constants

    _, bundled = folders
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setattr(constants, "ENDPOINT", dead)
    with pytest.raises(PushError, match=f"Hub at {dead}"):
        push(bundled, "someone/fat5-tiny", validate=False)


def test_convert_bundle_and_push_in_one_call(hub, tmp_path):
    source = make_checkpoint(tmp_path / "src", "flan-t5")
    result = convert_to_hub_folder(source, tmp_path / "out", push_to="someone/fat5-flan")
    assert result.output == tmp_path / "out"
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "AutoModelForSeq2SeqLM" in config["auto_map"]
    [(_, files)] = hub.commits()
    assert files == _bundle_files(tmp_path / "out")
    assert "someone/fat5-flan" in files["README.md"].decode()


def test_convert_push_without_token_fails_before_converting(hub, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN")
    source = make_checkpoint(tmp_path / "src", "t5")
    with pytest.raises(PushError, match="no Hugging Face token"):
        convert_to_hub_folder(source, tmp_path / "out", push_to="someone/fat5-t5")
    assert not (tmp_path / "out").exists() and hub.requests == []


def test_convert_from_a_hub_id_the_hub_does_not_have(hub, tmp_path):
    from fat5.conversion import ConversionError

    with pytest.raises(ConversionError, match="someone/absent: no such model on the Hub"):
        convert("someone/absent", tmp_path / "out")


def test_push_command_line(hub, folders, capsys):

    converted, bundled = folders
    parser = build_parser()
    args = parser.parse_args(
        [
            "push",
            str(bundled),
            "someone/fat5-tiny",
            "--private",
            "--revision",
            "dev",
            "--commit-message",
            "m",
            "--dry-run",
        ]
    )
    assert (args.private, args.revision, args.commit_message, args.dry_run) == (True, "dev", "m", True)
    args = parser.parse_args(["push", str(converted), "someone/fat5-tiny"])
    with pytest.raises(PushError, match="has no fat5_manifest.json"):
        args.func(args)
    assert hub.requests == []
