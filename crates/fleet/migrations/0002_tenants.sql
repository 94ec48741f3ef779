-- The fleet's tenants: each as the entry a node keeps (name, the SHA-256
-- of its token, its policy, when made and changed), so a tenant made on
-- one node is known to every node. Changes are announced on the
-- runbox_tenants channel; nodes keep a copy and reload it then.

CREATE TABLE runbox_tenants (
    name          text PRIMARY KEY,
    token_sha256  text NOT NULL UNIQUE,
    entry         jsonb NOT NULL,
    updated_at    timestamptz NOT NULL DEFAULT now()
);
