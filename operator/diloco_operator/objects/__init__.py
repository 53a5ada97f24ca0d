"""Pure builders of the Kubernetes objects a DilocoJob owns: manifests, warm spare pods, pod security, the syncer's
certificates."""
