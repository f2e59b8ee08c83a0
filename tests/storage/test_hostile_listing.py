"""A bucket's listing is input from whoever can write to the bucket: a key that would leave the
local view (``../`` segments, ``prefix//abs/path``, which ``pathlib`` makes absolute) refuses
the view, naming the object, before anything is downloaded, against the real S3 server. This
runs on every ``"last"`` resume from ``s3://`` (``newest_intact``) and for every command given
a URL (``open_view``)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("boto3")

KEYS = {
    "parent segments": "run/global_step_4/../../../../../../{target}",
    "double slash": "run//{target}",
    "step's double slash": "run/global_step_4//{target}",
}


def _publish_step(client: Any, bucket: str) -> None:
    files = {"model/.metadata": 5}
    meta = {"format_version": 2, "global_step": 4, "contents": ["model"], "files": files}
    client.put_object(Bucket=bucket, Key="run/global_step_4/model/.metadata", Body=b"index")
    client.put_object(
        Bucket=bucket, Key="run/global_step_4/metadata.json", Body=json.dumps(meta).encode()
    )


@pytest.mark.parametrize("url_names", ["dirpath", "step"])
@pytest.mark.parametrize("kind", KEYS)
def test_a_listing_naming_a_key_outside_the_view_is_refused_and_nothing_is_written(
    s3_bucket: str, s3_server: Any, kind: str, url_names: str
) -> None:
    from lightning_mcore_ckpt.safety.names import UnsafeNameError
    from lightning_mcore_ckpt.storage.store_views import open_view, resolve_url

    client = s3_server.client()
    _publish_step(client, s3_bucket)
    target = Path(tempfile.gettempdir(), f"lmc-planted-{os.getpid()}-{kind.replace(' ', '-')}")
    target.unlink(missing_ok=True)
    key = KEYS[kind].format(target=str(target).lstrip("/"))
    client.put_object(Bucket=s3_bucket, Key=key, Body=b"#!/bin/sh\necho planted\n")
    listed = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert key in listed  # the store keeps the hostile name as it was written
    url = f"s3://{s3_bucket}/run" + ("/global_step_4" if url_names == "step" else "")
    in_step = key.startswith("run/global_step_4/")
    if url_names == "step" and not in_step:
        open_view(url)  # a step's view lists that step alone: the key is not in it
    else:
        with pytest.raises(UnsafeNameError, match=f"the listing of s3://{s3_bucket}/run"):
            open_view(url)
    if in_step:  # a resume from "last" lists each candidate step's objects
        with pytest.raises(UnsafeNameError, match="the listing of"):
            resolve_url(url)
    assert not target.exists()
