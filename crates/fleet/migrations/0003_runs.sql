-- The fleet's run catalog: each run as its owner node last published it
-- (its API view), with the generation of that publication, so a write
-- older than what is there is refused. A destroyed run's row stays as a
-- tombstone (status 'gone') until it is cleaned up.

CREATE TABLE runbox_runs (
    id          text PRIMARY KEY,
    node        text NOT NULL,
    tenant      text,
    generation  bigint NOT NULL,
    status      text NOT NULL,
    run         jsonb NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX runbox_runs_node ON runbox_runs (node) WHERE status <> 'gone';
CREATE INDEX runbox_runs_tenant ON runbox_runs (tenant) WHERE status <> 'gone';
