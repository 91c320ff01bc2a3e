"""The `[responses]` table: what the routers keep of OpenAI Responses API answers
(services/router/openai_api/responses_kept.py)."""
from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import POSITIVE, Bounds, setting


@dataclass(slots=True)
class ResponsesConfig:
    """Stored responses: GET and DELETE /v1/responses/{id}, their input items, previous_response_id."""
    store: bool = setting(True, "keep the responses a request asks to keep (store: true, OpenAI's default) in the "
                          "store's database, its tenant's alone; false: none is kept, store: true is refused and "
                          "a request that leaves store out is answered with store: false")
    retention_s: float = setting(30 * 86400.0, "a kept response (its input and output) is deleted this long after "
                                 "it was made (OpenAI keeps 30 days)", bounds=POSITIVE)
    background_lease_s: float = setting(10.0, "a router running a background response renews its claim on it this "
                                        "often x 3; one whose router was lost is run again by another once its "
                                        "claim is this old (a streamed one, or one run 3 times, reads as failed)",
                                        bounds=POSITIVE)
    stream_events_s: float = setting(3600.0, "a background response made with stream true keeps its stream's events "
                                     "this long, for a client resuming it (GET /v1/responses/{id}?stream=true"
                                     "&starting_after=N) on any replica", bounds=POSITIVE)
    max_items: int = setting(10_000, "the most input items one response's conversation may hold, its earlier "
                             "responses' included (a longer one is refused naming previous_response_id)",
                             bounds=Bounds(1))
