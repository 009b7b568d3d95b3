"""On-disk formats shared between processes: the job store (training and evaluation jobs) and the
adapter registry. The supervisor reads them, the workers write them; they import nothing else of
Kiln's."""
