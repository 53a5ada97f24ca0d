{{/* The name of every object the chart creates (as in manifests/operator.yaml). */}}
{{- define "diloco.name" -}}diloco-operator{{- end -}}

{{/* Labels of the chart's objects; the pod's own label (diloco.selector) is what job NetworkPolicies admit. */}}
{{- define "diloco.labels" -}}
app.kubernetes.io/name: diloco-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator pods' selector; operator/diloco_operator/objects/builders.py OPERATOR_POD_LABELS names it. */}}
{{- define "diloco.selector" -}}
app.kubernetes.io/name: diloco-operator
{{- end -}}

{{/* The namespaces the operator watches, as JSON: watchNamespaces when given; else [] (every namespace) with
clusterWide; else the release's own namespace (the default: no cluster-wide right). */}}
{{- define "diloco.watched" -}}
{{- if and .Values.clusterWide .Values.watchNamespaces -}}
{{- fail "clusterWide: true watches every namespace: leave watchNamespaces empty (or set clusterWide: false)" -}}
{{- end -}}
{{- if .Values.watchNamespaces -}}{{ toJson .Values.watchNamespaces }}
{{- else if .Values.clusterWide -}}[]
{{- else -}}{{ list .Release.Namespace | toJson }}{{- end -}}
{{- end -}}

{{/* "true" when the operator reads Nodes: watchNodes, or by default only when it watches every namespace. */}}
{{- define "diloco.watchNodes" -}}
{{- if kindIs "invalid" .Values.watchNodes -}}{{ eq (include "diloco.watched" .) "[]" }}{{- else -}}{{ .Values.watchNodes }}{{- end -}}
{{- end -}}

{{/* The namespaced rules, the same for the ClusterRole and each Role (a test keeps them equal to the manifests'). */}}
{{- define "diloco.namespacedRules" -}}
# Every verb below is one the operator uses (docs/operator.md "RBAC").
# The jobs it reconciles: watched (kopf), read by spec.chaos; patch for kopf's finalizer on jobs whose chaos daemon
# runs, the remote-cleanup finalizer and the chaos start-time annotation (the operator never changes a spec).
- apiGroups: [diloco.dev]
  resources: [dilocojobs]
  verbs: [get, list, watch, patch]
- apiGroups: [diloco.dev]
  resources: [dilocojobs/status, learnerunits/status]
  verbs: [patch]
# Owner references with blockOwnerDeletion need update on the owner's finalizers.
- apiGroups: [diloco.dev]
  resources: [dilocojobs/finalizers, learnerunits/finalizers]
  verbs: [update]
- apiGroups: [diloco.dev]
  resources: [learnerunits]
  verbs: [list, watch, create, patch, delete]
# Learner pods: watched (label-filtered), created, deleted when healing; patch: spec.chaos's fail action (kwok).
- apiGroups: [""]
  resources: [pods]
  verbs: [list, watch, create, delete, patch]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch]
# The job's ConfigMaps (config, CA) are compared and updated; Services and PVCs are create-only. get (here and on
# Deployments and Secrets): an existing object of the name is used only if this job controls it.
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [services, persistentvolumeclaims]
  verbs: [get, create]
# Secrets, never listed or watched: the job's token and the units' tokens (created once, read back); the syncer's
# certificate, which it renews (spec.syncer.tls.mode Auto) and reads (mode Secret); a remote cluster's kubeconfig.
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
# Each job's NetworkPolicy for its syncer (updated when spec.clusters changes who may connect) and each unit's
# (create-only); get: an existing one of the name is used only if the job or unit controls it.
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, create, patch]
# Kueue (diloco operator --kueue): one Workload per unit of a queued job, created and watched (label-filtered); its
# status patched to hand an evicted unit's quota back and to mark an ended unit's Workload Finished.
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [list, watch, create]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [patch]
{{- end -}}

{{/* The one cluster-scoped rule: read-only Nodes (unit pools, the autoscaler's accelerator room, chaos's kwok check). */}}
{{- define "diloco.nodesRule" -}}
# Cluster-scoped, read-only: which pool a unit landed on and the accelerator capacity the autoscaler sees (watched,
# cached); get: spec.chaos's fail action checks the node is kwok's. Not needed with --no-watch-nodes.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, list, watch]
{{- end -}}

{{/* A PodMonitor's choice of one component's job pods (dict "root" . "component" NAME): in the watched namespaces
(all by default), managed by the operator, with their diloco.dev/* labels as target labels. */}}
{{- define "diloco.podMonitorJobPods" -}}
namespaceSelector:
{{- $watched := include "diloco.watched" .root | fromJsonArray }}
{{- if $watched }}
  matchNames:
  {{- toYaml $watched | nindent 2 }}
{{- else }}
  any: true
{{- end }}
podTargetLabels: [diloco.dev/job, diloco.dev/unit, diloco.dev/shard]
selector:
  matchLabels: {app.kubernetes.io/managed-by: diloco-operator, diloco.dev/component: {{ .component }}}
{{- end -}}

{{/* Kueue's cluster-scoped objects the operator reads (--kueue): ResourceFlavors and WorkloadPriorityClasses. */}}
{{- define "diloco.kueueRule" -}}
# Kueue (--kueue), cluster-scoped, read-only: the ResourceFlavor Kueue admitted a unit on (its node labels and
# tolerations go into the unit's pods) and the WorkloadPriorityClass a job names.
- apiGroups: [kueue.x-k8s.io]
  resources: [resourceflavors, workloadpriorityclasses]
  verbs: [get]
{{- end -}}
