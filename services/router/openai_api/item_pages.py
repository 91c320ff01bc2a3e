"""OpenAI's page of items (a response's input items, a conversation's): the query's `limit`
(1-100, 20 by default), `order` (`desc` by default) and `after` (an item id) over a list held
whole, and the list object answered. Pure."""
from __future__ import annotations

from services.common.errors import invalid

MAX_PAGE = 100


def page_query(params) -> tuple[int, str, str | None]:
    """(limit, order, after) from the query parameters; INVALID naming a bad one."""
    limit, order, after = params.get("limit", "20"), params.get("order", "desc"), params.get("after")
    if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= MAX_PAGE:     # ("²".isdigit())
        raise invalid(f"limit must be a number from 1 to {MAX_PAGE}, got {limit[:20]!r}", "limit")
    if order not in ("asc", "desc"):
        raise invalid(f'order must be "asc" or "desc", got {order[:20]!r}', "order")
    return int(limit), order, after


def item_page(items: list[dict], query: tuple[int, str, str | None]) -> dict:
    limit, order, after = query
    items = items if order == "asc" else items[::-1]
    if after is not None:
        items = items[next((k + 1 for k, item in enumerate(items) if item["id"] == after), len(items)):]
    return listed(items[:limit], len(items) > limit)


def listed(items: list[dict], more: bool) -> dict:
    return {"object": "list", "data": items, "has_more": more,
            "first_id": items[0]["id"] if items else None, "last_id": items[-1]["id"] if items else None}
