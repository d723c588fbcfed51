"""The typed bodies of the cluster's own routes (`framekv.tools.cluster.ingress`).
(No ``from __future__ import annotations``: FastAPI and pydantic read the annotations.)
"""
from pydantic import BaseModel, ConfigDict, Field


class MoveBody(BaseModel):
    """``POST /v1/sessions/{id}/move``: where to (default: the replica with the most
    free sessions)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    to: str | None = Field(None, description="A replica id (GET /v1/cluster/replicas).")


class MoveReport(BaseModel):
    """What a move did: its bytes and seconds."""

    id: str
    to: str
    bytes: int = Field(description="The stream's state: K/V, history, queued chunks.")
    export_s: float = Field(description="Seconds the session took to leave its replica.")
    transfer_s: float = Field(description="Seconds from leaving to arriving.")
    import_s: float = Field(description="Seconds the new replica took to open it.")
    seconds: float = Field(description="The whole move, as the ingress saw it.")
    from_: str = Field(alias="from", description="The replica it left.")

    model_config = ConfigDict(populate_by_name=True)


class ReplicaInfo(BaseModel):
    """One replica of the cluster."""

    id: str
    pid: int = Field(description="Its process on its host.")
    sessions: int = Field(description="Sessions placed there.")
    max_sessions: int
    slots: int
    draining: bool = Field(description="Whether it takes no new session (drained).")
    takes_sessions: bool = Field(description="Whether new sessions go there: not draining, "
                                             "its loop running.")
