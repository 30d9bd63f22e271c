"""A Hugging Face Hub cache laid out on disk, as `huggingface_hub` leaves it after a download
(refs/<branch> -> commit, snapshots/<commit>/<file> -> ../../blobs/<sha256>), so that
Hub ids resolve offline (HF_HUB_OFFLINE=1) with no network."""
from __future__ import annotations

import hashlib
import os
import shutil


def add_to_hub_cache(hf_home: str, repo_id: str, src_dir: str, commit: str | None = None,
                     branch: str = "main") -> str:
    """Put the files of ``src_dir`` in ``hf_home``'s Hub cache as ``repo_id`` at ``commit``
    (default: a hash of the files); ``branch`` points at it. -> the snapshot folder."""
    files = sorted(f for f in os.listdir(src_dir) if os.path.isfile(os.path.join(src_dir, f)))
    if commit is None:
        h = hashlib.sha1()
        for f in files:
            with open(os.path.join(src_dir, f), "rb") as fh:
                h.update(f.encode() + fh.read())
        commit = h.hexdigest()
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    snap = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for f in files:
        with open(os.path.join(src_dir, f), "rb") as fh:
            blob = hashlib.sha256(fh.read()).hexdigest()
        dst_blob = os.path.join(repo, "blobs", blob)
        if not os.path.exists(dst_blob):
            shutil.copyfile(os.path.join(src_dir, f), dst_blob)
        link = os.path.join(snap, f)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "..", "blobs", blob), link)
    with open(os.path.join(repo, "refs", branch), "w") as fh:
        fh.write(commit)
    return snap
