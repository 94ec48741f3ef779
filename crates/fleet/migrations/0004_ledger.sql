-- The fleet's part of the ledger: how many runs of each tenant each node
-- counts against the tenant's maxRuns (each row with the sequence number
-- of the node's change, so a late write never replaces a newer one), and
-- the idempotency keys of every node's creates with the run each made.

CREATE TABLE runbox_tenant_runs (
    tenant  text NOT NULL,
    node    text NOT NULL,
    runs    integer NOT NULL CHECK (runs >= 0),
    seq     bigint NOT NULL,
    PRIMARY KEY (tenant, node)
);

CREATE TABLE runbox_keys (
    tenant      text NOT NULL,
    key         text NOT NULL,
    request     text NOT NULL,
    run         text NOT NULL,
    node        text NOT NULL,
    taken_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);

CREATE INDEX runbox_keys_run ON runbox_keys (run);
