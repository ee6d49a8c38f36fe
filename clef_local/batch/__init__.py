"""``clef-local batch``: decide over a whole file of requests, resumable, on this machine or a Ray cluster
(docs/batch.md). ``job`` drives a job, ``io`` reads and writes the formats, ``journal`` commits chunks, ``work``
decides one (the same code locally and in a replica), ``replicas`` sizes replicas and ``ray_runner`` runs Ray Data.
"""
