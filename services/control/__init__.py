"""The control plane around the router's request path: tenants and keys, limits, the billing
ledger, SLA windows and alerts with their webhooks, the live console's feed, and adapter admin.

The request path (services/router/) calls into this package; nothing here imports the router.
Where a module needs something of a request (its head, its usage, its pool's price), it says so
with a small Protocol of its own, which the router's objects satisfy.
"""
