"""export.push_to_hub: the exported folder uploaded to a Hub repo through huggingface_hub, in one commit.

`create_repo` (private unless export.private=false), then one `upload_folder`, which is one commit: the repo shows
the whole folder or nothing of it. Offline (HF_HUB_OFFLINE=1), without a token, or into a namespace the token
cannot write (a repo that exists and is not ours): one line, nothing uploaded, the folder kept. A repo this call
created is deleted again when the upload fails, so a failure leaves no empty repo behind either.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo_cli.errors import UserFacingError


def _kept(folder: Path) -> str:
    return f"nothing was uploaded; the model is in {folder}"


def _offline() -> bool:
    from huggingface_hub import constants

    # constants.HF_HUB_OFFLINE is read when huggingface_hub is imported; the environment may have changed since.
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def push_folder(folder: Path, repo_id: str, private: bool) -> str:
    """Upload `folder` to model repo `repo_id` in one commit; returns the repo's URL. A one-line UserFacingError
    (nothing uploaded) when offline, without a token, for a repo id that is malformed or outside the token's
    namespaces, or when the Hub refuses."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    key = f"export.push_to_hub={repo_id}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise UserFacingError(
            f"{key}: not a repo id ({' '.join(str(error).split())[:150]}): give <user>/<name>"
        ) from None
    if _offline():
        raise UserFacingError(f"{key}: HF_HUB_OFFLINE=1 is set: {_kept(folder)}; unset it to push")
    token = get_token()
    if token is None:
        raise UserFacingError(
            f"{key}: no Hugging Face token (hf auth login, or HF_TOKEN with write access): {_kept(folder)}"
        )
    api = HfApi(token=token)
    try:
        who = api.whoami()
    except Exception as error:  # noqa: BLE001 - an HTTP or network error: the one line says which
        raise UserFacingError(f"{key}: the Hub did not accept the token ({_short(error)}): {_kept(folder)}") from None
    namespaces = {who.get("name")} | {org.get("name") for org in who.get("orgs", []) if isinstance(org, dict)}
    owner = repo_id.split("/")[0] if "/" in repo_id else who.get("name")
    if owner not in namespaces:
        raise UserFacingError(
            f"{key}: the token ({who.get('name')}) cannot write to {owner}'s repos: {_kept(folder)}; push to "
            f"{who.get('name')}/{repo_id.split('/')[-1]} or an organization of yours"
        )
    full_id = repo_id if "/" in repo_id else f"{owner}/{repo_id}"
    try:
        existed = api.repo_exists(full_id)
        api.create_repo(full_id, private=private, exist_ok=True, repo_type="model")
    except Exception as error:  # noqa: BLE001 - see whoami
        raise UserFacingError(f"{key}: could not create the repo ({_short(error)}): {_kept(folder)}") from None
    try:
        api.upload_folder(
            repo_id=full_id,
            folder_path=folder,
            repo_type="model",
            commit_message="grpo-cli export",
        )
    except Exception as error:  # noqa: BLE001 - see whoami
        if not existed:
            try:
                api.delete_repo(full_id, repo_type="model")
            except Exception:  # noqa: BLE001, S110 - the one line below still says what happened
                pass
        raise UserFacingError(f"{key}: the upload failed ({_short(error)}): {_kept(folder)}") from None
    return f"https://huggingface.co/{full_id}"


def _short(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
