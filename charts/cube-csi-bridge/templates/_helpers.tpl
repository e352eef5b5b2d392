{{/*
Names, labels and the values every template derives from.
*/}}

{{- define "cube-csi-bridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, at most 52 characters so that suffixes such as "-controller"
still fit the 63-character limit of names and label values.
*/}}
{{- define "cube-csi-bridge.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cube-csi-bridge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cube-csi-bridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cube-csi-bridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cube-csi-bridge.labels" -}}
helm.sh/chart: {{ include "cube-csi-bridge.chart" . }}
{{ include "cube-csi-bridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: cube-csi-bridge
{{- /* A label value must end with a letter or digit; the driver name may not. */}}
csibridge.cubesandbox.io/driver: {{ regexReplaceAll "[-._]+$" .Values.driver "" | quote }}
{{- end }}

{{/* The bridge image reference, with its digest when one is pinned. */}}
{{- define "cube-csi-bridge.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{/* ServiceAccount names of the two sides. */}}
{{- define "cube-csi-bridge.nodeServiceAccount" -}}
{{- printf "%s-node" (include "cube-csi-bridge.fullname" .) }}
{{- end }}
{{- define "cube-csi-bridge.controllerServiceAccount" -}}
{{- printf "%s-controller" (include "cube-csi-bridge.fullname" .) }}
{{- end }}

{{/* Cube sockets: the node side's (Cubelet) and the controller side's (CubeMaster). */}}
{{- define "cube-csi-bridge.nodeSocket" -}}
{{- printf "%s/%s.sock" (trimSuffix "/" .Values.socketDir) .Values.driver }}
{{- end }}
{{- define "cube-csi-bridge.controllerSocket" -}}
{{- printf "%s/%s-controller.sock" (trimSuffix "/" .Values.socketDir) .Values.driver }}
{{- end }}

{{/* "true" when the node side also serves Create/Destroy (node.services = both). */}}
{{- define "cube-csi-bridge.nodeServesController" -}}
{{- if and .Values.node.enabled (eq .Values.node.services "both") }}true{{ end }}
{{- end }}

{{/* "true" when the node side reads CubeVolumes to grow what `expand` recorded. */}}
{{- define "cube-csi-bridge.nodeFollowsExpansions" -}}
{{- if and .Values.node.enabled .Values.node.followExpansions }}true{{ end }}
{{- end }}

{{/* "true" when the node side talks to the Kubernetes API. */}}
{{- define "cube-csi-bridge.nodeUsesApi" -}}
{{- if and .Values.node.enabled (or .Values.kubernetes.storageClass (include "cube-csi-bridge.nodeServesController" .) (include "cube-csi-bridge.nodeFollowsExpansions" .)) }}true{{ end }}
{{- end }}

{{/* The socket CubeMaster registers, or nothing when no side serves Create/Destroy. */}}
{{- define "cube-csi-bridge.cubeMasterSocket" -}}
{{- if .Values.controller.enabled }}
{{- include "cube-csi-bridge.controllerSocket" . }}
{{- else if include "cube-csi-bridge.nodeServesController" . }}
{{- include "cube-csi-bridge.nodeSocket" . }}
{{- end }}
{{- end }}

{{/*
Checks across values that the schema cannot express; included by every workload template.
*/}}
{{- define "cube-csi-bridge.validate" -}}
{{- if and (not .Values.node.enabled) (not .Values.controller.enabled) }}
{{- fail "node.enabled and controller.enabled are both false: nothing to deploy" }}
{{- end }}
{{- if hasSuffix "-controller" .Values.driver }}
{{- fail (printf "driver %q must not end with -controller: the controller side of driver %q is the instance %q (its socket, state dir and lock dir), which this release would share on a host running both" .Values.driver (trimSuffix "-controller" .Values.driver) .Values.driver) }}
{{- end }}
{{- if and (include "cube-csi-bridge.nodeServesController" .) .Values.controller.enabled }}
{{- fail "node.services is \"both\": set controller.enabled=false (CubeMaster registers the node socket)" }}
{{- end }}
{{- if and (or .Values.controller.enabled (include "cube-csi-bridge.nodeServesController" .)) (not (regexMatch "[A-Za-z0-9]$" .Values.driver)) }}
{{- fail (printf "driver %q must end with a letter or digit: it labels the CubeVolume objects of the controller side" .Values.driver) }}
{{- end }}
{{- if and (include "cube-csi-bridge.nodeFollowsExpansions" .) (not (regexMatch "[A-Za-z0-9]$" .Values.driver)) }}
{{- fail (printf "driver %q must end with a letter or digit: the node side reads the CubeVolume objects it labels to follow expansions (node.followExpansions); rename the driver or set node.followExpansions=false" .Values.driver) }}
{{- end }}
{{- if .Values.kubernetes.storageClass }}
{{- with .Values.volume }}
{{- if or .parameters .mountFlags .fsType }}
{{- fail (printf "volume.parameters, volume.mountFlags and volume.fsType must be empty: they come from StorageClass %q (kubernetes.storageClass)" $.Values.kubernetes.storageClass) }}
{{- end }}
{{- end }}
{{- else if .Values.kubernetes.secrets }}
{{- fail "kubernetes.secrets is set but kubernetes.storageClass is empty: secrets are only read through a StorageClass's references" }}
{{- end }}
{{- end }}

{{/*
The Secret holding the key CubeVolume records are signed with (made by the bridge); the same
name the bridge derives from the driver when its config names none.
*/}}
{{- define "cube-csi-bridge.recordKeySecret" -}}
cube-csi-bridge-{{ regexReplaceAll "[^a-z0-9]" (lower .Values.driver) "-" }}-record-key
{{- end }}

{{/*
The shared part of a bridge config (TOML). Strings go through toJson: a JSON string is a
valid TOML basic string. Call with (dict "root" $ "side" "node"|"controller").
*/}}
{{- define "cube-csi-bridge.configCommon" -}}
{{- $v := .root.Values }}
{{- $side := .side }}
{{- $serveController := or (eq $side "controller") (include "cube-csi-bridge.nodeServesController" .root) }}
{{- $usesApi := or (eq $side "controller") (include "cube-csi-bridge.nodeUsesApi" .root) }}
{{- $instance := ternary (printf "%s-controller" $v.driver) $v.driver (eq $side "controller") -}}
# Rendered by Helm for release {{ .root.Release.Name }} ({{ $side }} side). Change the chart
# values, not this file.
driver = {{ $v.driver | toJson }}

[csi]
endpoint = "unix:///csi/csi.sock"
{{- if and (eq $side "node") $v.node.controllerEndpoint }}
controller_endpoint = {{ $v.node.controllerEndpoint | toJson }}
{{- end }}
{{- with $v.driverUids }}
driver_uids = {{ toJson . }}
{{- end }}

[serve]
socket = {{ ternary (include "cube-csi-bridge.controllerSocket" .root) (include "cube-csi-bridge.nodeSocket" .root) (eq $side "controller") | toJson }}
services = {{ ternary "controller" $v.node.services (eq $side "controller") | toJson }}
shutdown_grace_secs = {{ int64 $v.shutdownGraceSecs }}

[state]
dir = {{ printf "%s/%s" (trimSuffix "/" $v.stateDir) $instance | toJson }}
lock_dir = {{ printf "%s/%s/locks" (trimSuffix "/" $v.socketDir) $instance | toJson }}
{{- if or $serveController (and (eq $side "node") (include "cube-csi-bridge.nodeFollowsExpansions" .root)) }}
controller_store = "kubernetes"
{{- end }}

{{- if eq $side "node" }}

[node]
default_volume_base_dir = {{ $v.volumeBaseDir | toJson }}
mount_view = {{ $v.node.mountView | toJson }}
{{- end }}
{{- if $usesApi }}

[kubernetes]
namespace = {{ .root.Release.Namespace | toJson }}
{{- with $v.kubernetes.storageClass }}
storage_class = {{ . | toJson }}
{{- end }}
cache_secs = {{ int64 $v.kubernetes.cacheSecs }}
{{- if $serveController }}
record_key_secret = {{ include "cube-csi-bridge.recordKeySecret" .root | toJson }}
{{- with $v.kubernetes.recordKeySha256 }}
record_key_sha256 = {{ . | toJson }}
{{- end }}
{{- end }}
{{- end }}

[volume]
name_prefix = {{ $v.volume.namePrefix | toJson }}
access_mode = {{ $v.volume.accessMode | toJson }}
capacity_bytes = {{ int64 $v.volume.capacityBytes }}
{{- if hasKey $v.volume "mountGroup" }}
mount_group = {{ int64 $v.volume.mountGroup }}
{{- end }}
{{- if not $v.kubernetes.storageClass }}
fs_type = {{ $v.volume.fsType | toJson }}
mount_flags = [{{ range $i, $f := $v.volume.mountFlags }}{{ if $i }}, {{ end }}{{ $f | toJson }}{{ end }}]
{{- if $v.volume.parameters }}

[volume.parameters]
{{- range $k, $p := $v.volume.parameters }}
{{ $k | toJson }} = {{ $p | toString | toJson }}
{{- end }}
{{- end }}
{{- end }}
{{- with $v.volume.accessibilityRequirements }}

[volume.accessibility_requirements]
{{- range $list := list "requisite" "preferred" }}
{{- with index $v.volume.accessibilityRequirements $list }}
{{ $list }} = [{{ range $i, $t := . }}{{ if $i }}, {{ end }}{ {{ range $j, $k := keys $t | sortAlpha }}{{ if $j }}, {{ end }}{{ $k | toJson }} = {{ index $t $k | toString | toJson }}{{ end }} }{{ end }}]
{{- end }}
{{- end }}
{{- end }}
{{- if $v.metrics.enabled }}

[metrics]
# Loopback here; the container's args bind the pod's own IP (--metrics-listen-ip).
listen = {{ printf "127.0.0.1:%d" (include "cube-csi-bridge.metricsPort" (dict "root" .root "side" $side) | int) | toJson }}
volume_stats_interval_secs = {{ ternary (int64 $v.metrics.volumeStatsIntervalSecs) 0 (eq $side "node") }}
{{- end }}
{{- with $v.timeouts }}

[timeouts]
{{- with .createSecs }}
create_secs = {{ int64 . }}
{{- end }}
{{- with .destroySecs }}
destroy_secs = {{ int64 . }}
{{- end }}
{{- with .attachSecs }}
attach_secs = {{ int64 . }}
{{- end }}
{{- with .detachSecs }}
detach_secs = {{ int64 . }}
{{- end }}
{{- with .rollbackSecs }}
rollback_secs = {{ int64 . }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Environment every CSI driver container gets. Call with the driver values.
*/}}
{{- define "cube-csi-bridge.driverEnv" -}}
- name: CSI_ENDPOINT
  value: unix:///csi/csi.sock
- name: NODE_ID
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
{{- with .env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Environment of the bridge containers. */}}
{{- define "cube-csi-bridge.bridgeEnv" -}}
- name: RUST_LOG
  value: {{ .Values.logLevel | quote }}
- name: CUBE_CSI_BRIDGE_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
# state.instance, claimed in the state dir: another release of this driver name (the same
# host paths) is refused. Not in the config file, which kubelet updates in pods still
# running an older version during a rollout (one that knows no such key).
- name: CUBE_CSI_BRIDGE_INSTANCE
  value: {{ printf "%s/%s" .Release.Namespace .Release.Name | quote }}
{{- if .Values.metrics.enabled }}
# The metrics endpoint binds this address only: where Prometheus scrapes the pod, not every
# interface of the host whose network the pod may share.
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end }}
{{- end }}

{{/*
The bridge container's args: serve the side's config, with metrics bound to the pod's IP
when they are on. Call with (dict "root" $ "side" "node"|"controller").
*/}}
{{- define "cube-csi-bridge.bridgeArgs" -}}
args: [serve, --config, /etc/cube-csi-bridge/{{ .side }}.toml{{ if .root.Values.metrics.enabled }}, --metrics-listen-ip, "$(POD_IP)"{{ end }}]
{{- end }}

{{/*
The driver container's image reference, `<registry>/<repository>:<tag>`, or
`<repository>:<tag>` when image.registry is empty. Call with the driver values.
*/}}
{{- define "cube-csi-bridge.driverImage" -}}
{{- with .image.registry }}{{ . }}/{{ end }}
{{- printf "%s:%s" .image.repository .image.tag }}
{{- end }}

{{/*
The mount-namespace file the node side's mount checks read (node.mountView auto or a path),
or nothing (self, none).
*/}}
{{- define "cube-csi-bridge.cubeletNamespaceFile" -}}
{{- $view := .Values.node.mountView }}
{{- if eq $view "auto" }}/usr/local/services/cubetoolbox/cubeletmnt/mnt
{{- else if hasPrefix "/" $view }}{{ $view }}
{{- end }}
{{- end }}

{{/*
The bridge container's securityContext: uid 0 (the host directories it writes are
root-owned, and Kubernetes gives a non-root container no capabilities), no privilege
escalation, a read-only root, and only the capabilities its side and node.mountView need;
then the side's bridge.securityContext merged over it. Call with
(dict "root" $ "side" "node"|"controller").
*/}}
{{- define "cube-csi-bridge.bridgeSecurityContext" -}}
{{- $v := .root.Values }}
{{- $context := dict "runAsUser" 0 "runAsGroup" 0 "privileged" false "allowPrivilegeEscalation" false "readOnlyRootFilesystem" true "capabilities" (dict "drop" (list "ALL")) }}
{{- if and (eq .side "node") (include "cube-csi-bridge.cubeletNamespaceFile" .root) }}
{{- /* SYS_PTRACE: stat /proc/<pid>/ns/mnt of root processes to find one in Cubelet's
namespace; SYS_ADMIN and SYS_CHROOT: setns() into it (the reader child). */}}
{{- $_ := set $context.capabilities "add" (list "SYS_PTRACE" "SYS_ADMIN" "SYS_CHROOT") }}
{{- end }}
{{- $extra := ternary $v.node.bridge.securityContext $v.controller.bridge.securityContext (eq .side "node") }}
{{- toYaml (mustMergeOverwrite $context (deepCopy $extra)) }}
{{- end }}

{{/*
Liveness and readiness probes of a bridge container: `cube-csi-bridge probe` against the
daemon's socket. Call with (dict "root" $ "config" "/etc/cube-csi-bridge/<side>.toml").
*/}}
{{- define "cube-csi-bridge.bridgeProbes" -}}
{{- $config := .config }}
{{- range $kind, $p := .root.Values.probes }}
{{- if $p.enabled }}
{{ $kind }}Probe:
  exec:
    command:
      - cube-csi-bridge
      - probe
      {{- if eq $kind "readiness" }}
      - --ready
      {{- end }}
      - --config
      - {{ $config }}
      - --timeout
      - {{ max 1 (sub (int64 $p.timeoutSeconds) 1) | quote }}
  initialDelaySeconds: {{ int64 $p.initialDelaySeconds }}
  periodSeconds: {{ int64 $p.periodSeconds }}
  timeoutSeconds: {{ int64 $p.timeoutSeconds }}
  failureThreshold: {{ int64 $p.failureThreshold }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The bridge's Kubernetes API credentials as a projected volume, mounted into the bridge
container only (pods set automountServiceAccountToken: false, so the CSI driver container
gets no token). The same three files the automatic mount would give.
*/}}
{{- define "cube-csi-bridge.apiAccessVolume" -}}
- name: kube-api-access
  projected:
    defaultMode: 0400
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                fieldPath: metadata.namespace
{{- end }}
{{- define "cube-csi-bridge.apiAccessMount" -}}
- name: kube-api-access
  mountPath: /var/run/secrets/kubernetes.io/serviceaccount
  readOnly: true
{{- end }}

{{/* The metrics port of one side (node: metrics.port, controller: metrics.port + 1). */}}
{{- define "cube-csi-bridge.metricsPort" -}}
{{- if eq .side "controller" }}{{ add (int .root.Values.metrics.port) 1 }}{{ else }}{{ int .root.Values.metrics.port }}{{ end }}
{{- end }}

{{/* The bridge container's metrics port, when metrics are on. */}}
{{- define "cube-csi-bridge.metricsContainerPort" -}}
{{- if .root.Values.metrics.enabled }}
ports:
  - name: metrics
    containerPort: {{ include "cube-csi-bridge.metricsPort" . }}
    protocol: TCP
{{- end }}
{{- end }}
