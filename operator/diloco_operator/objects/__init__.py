"""Pure builders of the Kubernetes objects a DilocoJob owns: manifests, pod security, the syncer's certificates."""
