-- The fleet: one row that says which cluster key the fleet uses (as a
-- check value, never the key), and a row per node that ever joined.
-- Times are the database's (now()), so no node's clock is trusted.

CREATE TABLE runbox_cluster (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key_check   text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE runbox_nodes (
    id             text PRIMARY KEY,
    advertise      text NOT NULL,
    client_origin  text,
    version        text NOT NULL,
    lane           text NOT NULL,
    incarnation    text NOT NULL,
    capacity       integer NOT NULL CHECK (capacity >= 0),
    runs           integer NOT NULL DEFAULT 0 CHECK (runs >= 0),
    pools_ready    integer NOT NULL DEFAULT 0 CHECK (pools_ready >= 0),
    draining       boolean NOT NULL DEFAULT false,
    left_at        timestamptz,
    started_at     timestamptz NOT NULL DEFAULT now(),
    heartbeat      timestamptz NOT NULL DEFAULT now()
);
