"""Remote clusters (spec.clusters): their clients and which kubeconfigs are accepted."""
