"""The scheduler: its actor (``actor``: the I/O around the core), the core that plans and applies
steps without I/O (``core``, its types in ``types``, the drafts it merges in ``proposals``), the
queue policies (``policy`` names and builds them: FCFS in ``policy_queue``, SSJF with aging in
``policy_ssjf`` and ``policy_aging``, HRRN in ``policy_hrrn``), adaptive speculation
(``adaptive``, its settings in ``adaptive_config``) and what it reports (``observer``)."""
