"""framekv on a cluster: ``framekv serve --replicas N`` on Ray Serve.

    client ──HTTP/WS──> ingress (`Ingress`: the API and page of one server, over
                        `ClusterSessions`: session id -> replica)
                           │ calls naming a replica (`ReplicaRouter`)
                           ▼
                        replica × N (`Replica`: one `StreamScheduler`, one GPU each)
                           │ moves: `export_session` -> Ray's object store ->
                           │ `import_session`; files in the shared state folder
                           ▼ for a replica that stops or dies (`Replica.adopt`)

``replica.py`` the replica deployment's class; ``router.py`` its request router;
``sessions.py`` the ingress's placement and session calls, ``moves.py`` its replicas,
adoptions, moves, drains and their undoing; ``ingress.py`` the ingress deployment and
the cluster's own routes (behind ``--admin-token`` where one is set); ``models.py``
their bodies;
``command.py`` the command line. Ray is imported by the command and the deployments
only (``pip install 'framekv[cluster]'``).
"""
