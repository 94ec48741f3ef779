-- Work one node of the fleet does at a time (sweeps of what the nodes
-- share), each under a lease: which node holds it, until when (the
-- database's clock), and a fencing number that grows with every change of
-- holder, so work started under an older number can be told apart.

CREATE TABLE runbox_singletons (
    name    text PRIMARY KEY,
    holder  text NOT NULL,
    fence   bigint NOT NULL,
    until   timestamptz NOT NULL
);
