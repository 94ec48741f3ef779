-- Secrets the nodes of a fleet hold alike that cannot be derived from the
-- cluster key (the egress interception CA, a key pair made once): each
-- sealed under a key derived from the cluster key, so the database alone
-- does not give them away. The first node to store one wins.

CREATE TABLE runbox_shared (
    name     text PRIMARY KEY,
    sealed   text NOT NULL,
    made_at  timestamptz NOT NULL DEFAULT now()
);
