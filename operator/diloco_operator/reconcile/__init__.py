"""The operator's I/O shell: the work queue, the job and unit reconcilers, writes, the watch cache, the syncer poller,
spare pods, Kueue, a job's objects in remote clusters and its chaos runs."""
