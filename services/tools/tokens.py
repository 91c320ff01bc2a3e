"""`qos-serve tokens init DIR`: a token for each role of the cluster, and the digests that tell
them apart (services/common/cluster_auth.py).

Writes DIR/ROLE.token for each role (router, scheduler, worker, admin; 256 random bits, prefixed
with the role so a person can tell them apart, readable by their owner only) and DIR/roles, each
role's SHA-256 digest. A service needs its own ROLE.token and `roles`; give it no other role's
token. `qos-serve tokens env DIR` prints the same as shell exports, for docker compose.
"""
from __future__ import annotations

from pathlib import Path

from services.common.cluster_auth import ROLES, ROLES_FILE, make_tokens, write_tokens


def init(directory: Path, force: bool = False) -> list[Path]:
    """Every role's token and the digests in `directory`; the files written. Refuses to replace
    existing tokens without `force`: the services holding them would be shut out."""
    if (directory / ROLES_FILE).exists() and not force:
        raise FileExistsError(f"{directory / ROLES_FILE} exists; --force replaces every role's token")
    return write_tokens(directory, make_tokens())


def env(directory: Path) -> str:
    """Shell exports of every role's token and the digests, as docker-compose.yml reads them."""
    lines = [f"export QOS_{role.upper()}_TOKEN={(directory / f'{role}.token').read_text().strip()}"
             for role in ROLES]
    digests = ",".join((directory / ROLES_FILE).read_text().split())
    return "\n".join([*lines, f"export QOS_CLUSTER_ROLES={digests}"]) + "\n"
