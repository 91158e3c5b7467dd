"""A Hugging Face Hub stand-in: a real HTTP server on 127.0.0.1 speaking the endpoints huggingface_hub 2.x calls
to create a repo and upload a folder (checked against huggingface_hub/hf_api.py, _commit_api.py and lfs.py).

    POST /api/repos/create                         {name, organization, visibility} -> {url}; 409 if it exists
    GET  /api/models/{repo}[/revision/{rev}]       repo_info (create_repo's fallback after a 401/403)
    POST /api/models/{repo}/branch/{branch}        {startingPoint?}; 409 if it exists
    POST /api/validate-yaml                        {content, repoType} -> {errors, warnings}
    POST /api/models/{repo}/preupload/{rev}        {files: [{path, sample (b64, 512 B), size}]} -> upload modes
    POST /{repo}.git/info/lfs/objects/batch        git-LFS batch API ("basic" transfer)
    PUT  /lfs-objects/{oid}                        the LFS object itself (sha256 checked)
    POST /{repo}.git/info/lfs/objects/verify       {oid, size}
    POST /api/models/{repo}/commit/{rev}           NDJSON: header, file (base64), lfsFile (oid), deletedFile

Auth works like the Hub's: an unknown token gets 401 "Invalid credentials in Authorization header"; a token may
write only to its user's namespace (403 otherwise); a private repo is invisible to others (404 RepoNotFound).
`fail_next(endpoint, status)` makes the next call of one endpoint answer `status` (e.g. a 500 at commit time).
A commit applies all of its operations or none: the tree of a branch only changes when the commit succeeds.
The Xet upload path is not implemented: clients must set HF_HUB_DISABLE_XET (the tests do).
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

# The patterns of the default .gitattributes the Hub writes into a new model repo (the subset that matters here).
LFS_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf", "*.h5", "*.onnx", "*.msgpack", "*.zip")
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub sends files of 10 MiB and more to LFS whatever their name
GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in LFS_PATTERNS).encode()


@dataclass
class Commit:
    oid: str
    summary: str
    description: str
    added: dict[str, bytes]  # path -> content
    deleted: list[str]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=dict)  # branch -> commits, oldest first

    def tree(self, branch: str = "main") -> dict[str, bytes]:
        files: dict[str, bytes] = {}
        for c in self.branches[branch]:
            for p in c.deleted:
                files.pop(p, None)
            files.update(c.added)
        return files


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class HubStandin:
    """`with HubStandin(tokens={"hf_alice": "alice"}) as hub:` -> hub.endpoint, hub.repos, hub.calls."""

    def __init__(self, tokens: dict[str, str]):
        self.tokens = dict(tokens)  # token -> user name
        self.repos: dict[str, Repo] = {}
        self.lfs: dict[str, bytes] = {}  # sha256 hex -> content
        self.calls: list[tuple[str, str]] = []  # (endpoint name, path) in arrival order
        self._forced: dict[str, int] = {}
        self._lock = threading.Lock()  # one request at a time mutates state
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> HubStandin:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def add_repo(self, repo_id: str, private: bool = False, files: dict[str, bytes] | None = None) -> Repo:
        repo = Repo(repo_id, private)
        repo.branches["main"] = [Commit(_oid(repo_id, "initial"), "initial commit", "", {".gitattributes": GITATTRIBUTES}, [])]
        if files:
            repo.branches["main"].append(Commit(_oid(repo_id, "files"), "files", "", dict(files), []))
        self.repos[repo_id] = repo
        return repo

    def fail_next(self, endpoint: str, status: int) -> None:
        self._forced[endpoint] = status

    # --- auth -------------------------------------------------------------------------------------------------

    def _user(self, headers) -> str:
        auth = headers.get("Authorization", "")
        user = self.tokens.get(auth.removeprefix("Bearer ")) if auth.startswith("Bearer ") else None
        if user is None:
            raise HubError(401, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_id: str, user: str, write: bool) -> Repo:
        repo = self.repos.get(repo_id)
        owner = repo_id.split("/")[0]
        if repo is None or (repo.private and owner != user):
            raise HubError(404, "Repository not found", "RepoNotFound")
        if write and owner != user:
            raise HubError(403, f"You don't have write access to {repo_id}")
        return repo

    @staticmethod
    def _branch(repo: Repo, rev: str) -> list[Commit]:
        if rev not in repo.branches:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.branches[rev]

    # --- endpoints: route() finds the handler; handler(self, user, body, *path args) -> JSON answer ----------

    def route(self, method: str, path: str, headers, body: bytes) -> tuple[str, int, object]:
        parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
        name, handler, args = _match(method, parts)
        self.calls.append((name, path))
        if name in self._forced:
            return name, self._forced.pop(name), {"error": f"forced failure of {name}"}
        if name == "lfs-put":  # pre-signed storage URL: no Authorization header, like S3
            return name, 200, self.lfs_put(body, *args)
        return name, 200, handler(self, self._user(headers), body, *args)

    def create(self, user, body):
        p = json.loads(body)
        repo_id = f"{p.get('organization') or user}/{p['name']}"
        if repo_id.split("/")[0] != user:
            raise HubError(403, f"You don't have the rights to create a model under the namespace \"{repo_id.split('/')[0]}\"")
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo", url=f"{self.endpoint}/{repo_id}")  # as the Hub does
        self.add_repo(repo_id, private=p.get("visibility") == "private")
        return {"url": f"{self.endpoint}/{repo_id}", "name": repo_id}

    def info(self, user, body, repo_id, rev="main"):
        repo = self._repo(repo_id, user, write=False)
        commits = self._branch(repo, rev)
        files = repo.tree(rev)
        return {"id": repo_id, "sha": commits[-1].oid, "private": repo.private, "siblings": [{"rfilename": f} for f in sorted(files)]}

    def branch(self, user, body, repo_id, branch):
        repo = self._repo(repo_id, user, write=True)
        if branch in repo.branches:
            raise HubError(409, "Reference already exists")
        start = (json.loads(body or b"{}") or {}).get("startingPoint", "main")
        repo.branches[branch] = list(self._branch(repo, start))
        return {}

    def validate_yaml(self, user, body):
        content = json.loads(body)["content"]
        if not content.startswith("---\n"):
            return {"errors": [], "warnings": [{"message": "empty or missing yaml metadata in repo card"}]}
        try:
            meta = yaml.safe_load(content[4:].split("\n---\n", 1)[0])
        except yaml.YAMLError as e:
            raise HubError(400, f"Invalid YAML in README.md: {e}") from e
        if not isinstance(meta, dict):
            raise HubError(400, "README.md metadata must be a YAML mapping")
        return {"errors": [], "warnings": []}

    def preupload(self, user, body, repo_id, rev):
        repo = self._repo(repo_id, user, write=True)
        tree = repo.tree(rev) if rev in repo.branches else self._branch(repo, rev)
        out = []
        for f in json.loads(body)["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = any(fnmatch.fnmatch(f["path"], p) for p in LFS_PATTERNS) or b"\0" in sample or f["size"] >= LFS_MIN_SIZE
            old = tree.get(f["path"])
            oid = None if old is None else (hashlib.sha256(old).hexdigest() if lfs else _git_sha1(old))
            out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        return {"files": out, "commitOid": repo.branches[rev][-1].oid}

    def lfs_batch(self, user, body, repo_id):
        self._repo(repo_id, user, write=True)
        p = json.loads(body)
        objects = []
        for o in p["objects"]:
            entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.lfs:
                entry["actions"] = {
                    "upload": {"href": f"{self.endpoint}/lfs-objects/{o['oid']}", "header": {}},
                    "verify": {"href": f"{self.endpoint}/{repo_id}.git/info/lfs/objects/verify", "header": {}},
                }
            objects.append(entry)
        return {"transfer": "basic", "objects": objects}

    def lfs_put(self, body, oid):
        if hashlib.sha256(body).hexdigest() != oid:
            raise HubError(400, f"content does not hash to {oid}")
        self.lfs[oid] = body
        return {}

    def lfs_verify(self, user, body, repo_id):
        self._repo(repo_id, user, write=True)
        p = json.loads(body)
        if p["oid"] not in self.lfs or len(self.lfs[p["oid"]]) != p["size"]:
            raise HubError(404, f"object {p['oid']} was not uploaded")
        return {}

    def commit(self, user, body, repo_id, rev):
        repo = self._repo(repo_id, user, write=True)
        commits = self._branch(repo, rev)
        lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        if not lines or lines[0]["key"] != "header":
            raise HubError(400, "the first NDJSON line must be the header")
        added: dict[str, bytes] = {}
        deleted: list[str] = []
        for item in lines[1:]:
            v = item["value"]
            if item["key"] == "file":
                added[v["path"]] = base64.b64decode(v["content"])
            elif item["key"] == "lfsFile":
                if v["oid"] not in self.lfs:
                    raise HubError(422, f"LFS object {v['oid']} for {v['path']} was never uploaded")
                added[v["path"]] = self.lfs[v["oid"]]
            elif item["key"] in ("deletedFile", "deletedFolder"):
                deleted.append(v["path"])
            else:
                raise HubError(400, f"unknown commit operation {item['key']}")
        head = lines[0]["value"]
        oid = _oid(repo_id, rev, str(len(commits)), head["summary"])
        commits.append(Commit(oid, head["summary"], head.get("description", ""), added, deleted))
        return {"success": True, "commitOid": oid, "commitUrl": f"{self.endpoint}/{repo_id}/commit/{oid}"}


# (method, pattern) -> (endpoint name, handler); "*" matches one path segment, "**" two (OWNER/NAME)
ROUTES = [
    ("POST", ["api", "repos", "create"], "create", HubStandin.create),
    ("GET", ["api", "models", "**"], "info", HubStandin.info),
    ("GET", ["api", "models", "**", "revision", "*"], "info", HubStandin.info),
    ("POST", ["api", "models", "**", "branch", "*"], "branch", HubStandin.branch),
    ("POST", ["api", "validate-yaml"], "validate-yaml", HubStandin.validate_yaml),
    ("POST", ["api", "models", "**", "preupload", "*"], "preupload", HubStandin.preupload),
    ("POST", ["**.git", "info", "lfs", "objects", "batch"], "lfs-batch", HubStandin.lfs_batch),
    ("POST", ["**.git", "info", "lfs", "objects", "verify"], "lfs-verify", HubStandin.lfs_verify),
    ("PUT", ["lfs-objects", "*"], "lfs-put", HubStandin.lfs_put),
    ("POST", ["api", "models", "**", "commit", "*"], "commit", HubStandin.commit),
]


def _match(method: str, parts: list[str]):
    for m, pattern, name, handler in ROUTES:
        if m != method:
            continue
        args, i = [], 0
        for p in pattern:
            if p.startswith("**"):
                if i + 2 > len(parts) or not parts[i + 1].endswith(p[2:]):
                    break
                args.append(f"{parts[i]}/{parts[i + 1].removesuffix(p[2:])}")
                i += 2
            elif i < len(parts) and (p == "*" or p == parts[i]):
                if p == "*":
                    args.append(parts[i])
                i += 1
            else:
                break
        else:
            if i == len(parts):
                return name, handler, args
    raise HubError(404, f"no such endpoint: {method} /{'/'.join(parts)}")


def _handler_for(hub: HubStandin):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep pytest output clean
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                out = b""
                while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                    out += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
                return out
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _serve(self):
            body = self._body()
            headers: dict[str, str] = {}
            try:
                with hub._lock:
                    _, status, payload = hub.route(self.command, self.path, self.headers, body)
            except HubError as e:
                status, payload = e.status, {"error": e.message, **e.extra}
                headers["X-Error-Message"] = e.message
                if e.code:
                    headers["X-Error-Code"] = e.code
            data = json.dumps(payload).encode()
            self.send_response(status)
            for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **headers}.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = _serve

    return Handler


def _oid(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
