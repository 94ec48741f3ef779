-- Runs move between nodes. Each catalog row may carry its run's whole
-- record sealed under a key derived from the cluster key (the database
-- alone does not open it), so the node a run moves to, or a node that
-- takes over an archived run of a node that is gone, can make the run
-- again from it. A row's node is its owner: only the owner writes the
-- row, and a change of owner is one compare-and-set on it, kept here as a
-- move, so a node that comes back finds what moved away while it was gone.

ALTER TABLE runbox_runs ADD COLUMN record text;

CREATE TABLE runbox_moves (
    seq        bigserial PRIMARY KEY,
    run        text NOT NULL,
    from_node  text NOT NULL,
    to_node    text NOT NULL,
    reason     text NOT NULL,
    at         timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX runbox_moves_run ON runbox_moves (run, seq);
