{{/*
Names and labels.
*/}}
{{- define "pdcoord.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pdcoord.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pdcoord.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of a component's objects: <fullname>-<component>, kept within 63 characters. */}}
{{- define "pdcoord.componentName" -}}
{{- printf "%s-%s" (include "pdcoord.fullname" .root | trunc (int (sub 62 (len .component))) | trimSuffix "-") .component }}
{{- end }}

{{- define "pdcoord.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdcoord.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "pdcoord.labels" -}}
helm.sh/chart: {{ include "pdcoord.chart" .root }}
{{ include "pdcoord.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdcoord
{{- end }}

{{- define "pdcoord.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pdcoord.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The pdcoord cluster name shared by masters and agents. */}}
{{- define "pdcoord.cluster" -}}
{{- default .Release.Name .Values.cluster }}
{{- end }}

{{- define "pdcoord.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "pdcoord.nodeagent.image" -}}
{{- $repo := default .Values.image.repository .Values.nodeagent.image.repository }}
{{- $tag := default (default .Chart.AppVersion .Values.image.tag) .Values.nodeagent.image.tag }}
{{- printf "%s:%s" $repo $tag }}
{{- end }}

{{/*
etcd.
*/}}
{{- define "pdcoord.etcd.fullname" -}}
{{- include "pdcoord.componentName" (dict "root" . "component" "etcd") }}
{{- end }}

{{- define "pdcoord.etcd.headless" -}}
{{- printf "%s-headless" (include "pdcoord.etcd.fullname" . | trunc 54 | trimSuffix "-") }}
{{- end }}

{{/* DNS name of etcd member i (pod i of the StatefulSet via the headless Service). Takes (dict "root" $ "i" N). */}}
{{- define "pdcoord.etcd.memberHost" -}}
{{- printf "%s-%d.%s.%s.svc.%s" (include "pdcoord.etcd.fullname" .root) (int .i) (include "pdcoord.etcd.headless" .root) .root.Release.Namespace .root.Values.clusterDomain }}
{{- end }}

{{/* --initial-cluster: name=peerURL for every member, built from etcd.replicaCount. */}}
{{- define "pdcoord.etcd.initialCluster" -}}
{{- $root := . }}
{{- $members := list }}
{{- range $i := until (int .Values.etcd.replicaCount) }}
{{- $host := include "pdcoord.etcd.memberHost" (dict "root" $root "i" $i) }}
{{- $members = append $members (printf "%s-%d=%s://%s:%d" (include "pdcoord.etcd.fullname" $root) $i (include "pdcoord.etcd.scheme" $root) $host (int $root.Values.etcd.peerPort)) }}
{{- end }}
{{- join "," $members }}
{{- end }}

{{/*
etcd TLS. "pdcoord.etcd.serverTLS" is non-empty when the bundled etcd serves TLS; the Secrets are named
by "pdcoord.etcd.serverSecret" (etcd pods) and "pdcoord.etcd.clientSecret" (masters, agents).
*/}}
{{- define "pdcoord.etcd.serverTLS" -}}
{{- $t := .Values.etcd.tls }}
{{- if and .Values.etcd.enabled (or $t.existingSecret $t.serverSecret $t.certManager.enabled) }}true{{ end }}
{{- end }}

{{- define "pdcoord.etcd.scheme" -}}
{{- ternary "https" "http" (eq (include "pdcoord.etcd.serverTLS" .) "true") }}
{{- end }}

{{- define "pdcoord.etcd.serverSecret" -}}
{{- $t := .Values.etcd.tls }}
{{- if $t.serverSecret }}{{ $t.serverSecret }}
{{- else if $t.existingSecret }}{{ $t.existingSecret }}
{{- else if $t.certManager.enabled }}{{ include "pdcoord.etcd.fullname" . }}-server-tls
{{- end }}
{{- end }}

{{- define "pdcoord.etcd.clientSecret" -}}
{{- $t := .Values.etcd.tls }}
{{- if $t.clientSecret }}{{ $t.clientSecret }}
{{- else if $t.existingSecret }}{{ $t.existingSecret }}
{{- else if and .Values.etcd.enabled $t.certManager.enabled }}{{ include "pdcoord.etcd.fullname" . }}-client-tls
{{- end }}
{{- end }}

{{/*
The etcd endpoints (HOST:PORT,...) every master and agent connects to: each member of the bundled
etcd, or etcd.endpoints when etcd.enabled is false.
*/}}
{{- define "pdcoord.etcd.endpoints" -}}
{{- if .Values.etcd.enabled }}
{{- $root := . }}
{{- $eps := list }}
{{- range $i := until (int .Values.etcd.replicaCount) }}
{{- $eps = append $eps (printf "%s:%d" (include "pdcoord.etcd.memberHost" (dict "root" $root "i" $i)) (int $root.Values.etcd.clientPort)) }}
{{- end }}
{{- join "," $eps }}
{{- else }}
{{- if not .Values.etcd.endpoints }}
{{- fail "etcd.enabled is false: set etcd.endpoints to the HOST:PORT list of your etcd cluster" }}
{{- end }}
{{- join "," .Values.etcd.endpoints }}
{{- end }}
{{- end }}

{{/*
pdmaster.
*/}}
{{- define "pdcoord.master.fullname" -}}
{{- include "pdcoord.componentName" (dict "root" . "component" "master") }}
{{- end }}

{{/* Model name the masters serve: master.model, else demo.model in demo mode, else none. */}}
{{- define "pdcoord.master.model" -}}
{{- if .Values.master.model }}
{{- .Values.master.model }}
{{- else if .Values.demo.enabled }}
{{- .Values.demo.model }}
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds of a master: longer than the preStop sleep plus the drain. */}}
{{- define "pdcoord.master.terminationGrace" -}}
{{- $m := .Values.master }}
{{- $floor := add (int $m.preStopSleepSeconds) (int $m.drainTimeout) }}
{{- if kindIs "invalid" $m.terminationGracePeriodSeconds }}
{{- add $floor (int $m.terminationGraceMargin) }}
{{- else }}
{{- if le (int $m.terminationGracePeriodSeconds) (int $floor) }}
{{- fail (printf "master.terminationGracePeriodSeconds (%d) must be greater than master.preStopSleepSeconds + master.drainTimeout (%d), or pdmaster is killed before it has drained" (int $m.terminationGracePeriodSeconds) (int $floor)) }}
{{- end }}
{{- int $m.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/* Pod anti-affinity term. Takes (dict "root" $ "component" NAME "mode" preferred|required "topologyKey" KEY). */}}
{{- define "pdcoord.antiAffinity" -}}
podAntiAffinity:
{{- if eq .mode "required" }}
  requiredDuringSchedulingIgnoredDuringExecution:
    - topologyKey: {{ .topologyKey }}
      labelSelector:
        matchLabels:
          {{- include "pdcoord.selectorLabels" . | nindent 10 }}
{{- else }}
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: {{ .topologyKey }}
        labelSelector:
          matchLabels:
            {{- include "pdcoord.selectorLabels" . | nindent 12 }}
{{- end }}
{{- end }}

{{/*
The nodeagent sidecar container.

Add it to the containers of any SGLang or vLLM prefill/decode pod (see README.md):

  containers:
    - name: engine
      ...
    {{- include "pdcoord.nodeagent.container" (dict "root" $ "role" "decode" "enginePort" 30000 "capacity" 64) | nindent 4 }}

Keys of the dict:
  root           the chart's root context ($), required
  role           prefill | decode, required
  enginePort     port of the engine's HTTP server in the same pod (default 30000)
  engineScheme   http | https (default http)
  capacity       running_max_req_size to report; omitted: read from the engine's /get_server_info
  bootstrapPort  SGLang disaggregation bootstrap port (prefill only)
  model          model name the engine serves (optional)
  metricsUrl     engine metrics URL for the load probe (default nodeagent.metricsUrl, else <endpoint>/metrics)
  name           container name (default "nodeagent")

The node id is the pod name and the endpoint the pod IP (downward API), so each replica of a
Deployment registers as its own node. With tls.grpc or etcd.tls / etcd.auth set, the pod also needs
the volumes of "pdcoord.nodeagent.volumes".
*/}}
{{- define "pdcoord.nodeagent.container" -}}
{{- $root := required "pdcoord.nodeagent.container: pass the root context as \"root\"" .root }}
{{- $role := required "pdcoord.nodeagent.container: \"role\" is required (prefill or decode)" .role }}
{{- if not (has $role (list "prefill" "decode")) }}
{{- fail (printf "pdcoord.nodeagent.container: role must be prefill or decode, got %q" $role) }}
{{- end }}
{{- $port := int (default 30000 .enginePort) }}
{{- $scheme := default "http" .engineScheme }}
{{- $na := $root.Values.nodeagent }}
{{- $metricsUrl := default $na.metricsUrl .metricsUrl -}}
- name: {{ default "nodeagent" .name }}
  image: {{ include "pdcoord.nodeagent.image" $root | quote }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command: ["nodeagent"]
  args:
    - --etcd={{ include "pdcoord.etcd.endpoints" $root }}
    - --cluster={{ include "pdcoord.cluster" $root }}
    - --node-id=$(NODEAGENT_NODE_ID)
    - --role={{ $role }}
    - --endpoint={{ $scheme }}://$(POD_IP):{{ $port }}
    {{- if not (kindIs "invalid" .capacity) }}
    - --running-max-req-size={{ int .capacity }}
    {{- end }}
    {{- if not (kindIs "invalid" .bootstrapPort) }}
    - --bootstrap-port={{ int .bootstrapPort }}
    {{- end }}
    {{- with .model }}
    - --model={{ . }}
    {{- end }}
    {{- if $metricsUrl }}
    - --metrics-url={{ $metricsUrl }}
    {{- end }}
    {{- if not $na.loadProbe }}
    - --no-load-probe
    {{- end }}
    - --handover={{ default "strict" $na.handover }}
    - --share-policy={{ default "demand" $na.sharePolicy }}
    {{- if and (hasKey $na "goneOnRefusal") (not $na.goneOnRefusal) }}
    - --no-gone-on-refusal
    {{- end }}
    - --health-port={{ int $na.healthPort }}
    {{- if $na.engineHealth.enabled }}
    - --health-interval={{ $na.engineHealth.interval }}
    - --health-timeout={{ $na.engineHealth.timeout }}
    - --health-failures={{ int $na.engineHealth.failures }}
    - --health-successes={{ int $na.engineHealth.successes }}
    {{- else }}
    - --no-health-check
    {{- end }}
    - --lease-ttl={{ $root.Values.leaseTtl }}
    - --log-level={{ $root.Values.logLevel }}
    {{- if include "pdcoord.grpc.agentSecret" $root }}
    - --grpc-tls-ca=/etc/pdcoord/grpc-tls/ca.crt
    - --grpc-tls-server-name={{ include "pdcoord.grpc.serverName" $root }}
    {{- if $root.Values.tls.grpc.mutual }}
    - --grpc-tls-cert=/etc/pdcoord/grpc-tls/tls.crt
    - --grpc-tls-key=/etc/pdcoord/grpc-tls/tls.key
    {{- end }}
    {{- end }}
    {{- with (include "pdcoord.etcd.securityArgs" $root | trim) }}
    {{- . | nindent 4 }}
    {{- end }}
    {{- with $na.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    - name: NODEAGENT_NODE_ID
      valueFrom:
        fieldRef:
          fieldPath: metadata.name
    - name: PYTHONDONTWRITEBYTECODE
      value: "1"
    - name: PYTHONUNBUFFERED
      value: "1"
    {{- with $na.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: agent-health
      containerPort: {{ int $na.healthPort }}
      protocol: TCP
  livenessProbe:
    httpGet:
      path: /health
      port: agent-health
    {{- toYaml $na.livenessProbe | nindent 4 }}
  resources:
    {{- toYaml $na.resources | nindent 4 }}
  securityContext:
    {{- toYaml (merge (deepCopy (default dict $na.securityContext)) (deepCopy $root.Values.securityContext)) | nindent 4 }}
  {{- with (include "pdcoord.security.volumeMounts" (dict "root" $root "component" "nodeagent") | trim) }}
  volumeMounts:
    {{- . | nindent 4 }}
  {{- end }}
{{- end }}

{{/*
Transport security. Secrets are referenced by name and mounted read-only under /etc/pdcoord:
  grpc-tls   tls.grpc.existingSecret (masters) / tls.grpc.agentSecret (agents): tls.crt, tls.key, ca.crt
  etcd-tls   etcd.tls.existingSecret: ca.crt (+ tls.crt, tls.key with etcd.tls.clientCert)
  etcd-auth  etcd.auth.existingSecret: the password under etcd.auth.passwordKey
  api-keys   master.apiKeys.existingSecret: one key per line under master.apiKeys.key
*/}}
{{- define "pdcoord.security.check" -}}
{{- $e := .Values.etcd }}
{{- if and (or $e.tls.serverSecret $e.tls.certManager.enabled) (not $e.enabled) }}
{{- fail "etcd.tls.serverSecret and etcd.tls.certManager configure the bundled etcd (etcd.enabled=true); for an external etcd set etcd.tls.existingSecret" }}
{{- end }}
{{- if and $e.enabled $e.tls.certManager.enabled }}
{{- if not ($.Capabilities.APIVersions.Has "cert-manager.io/v1/Certificate") }}
{{- fail "etcd.tls.certManager.enabled needs cert-manager's Certificate CRD (cert-manager.io/v1), which this cluster does not serve" }}
{{- end }}
{{- if not $e.tls.certManager.issuerRef.name }}
{{- fail "etcd.tls.certManager.enabled needs etcd.tls.certManager.issuerRef.name" }}
{{- end }}
{{- end }}
{{- if and (include "pdcoord.etcd.serverTLS" .) (not (include "pdcoord.etcd.clientSecret" .)) }}
{{- fail "the bundled etcd serves TLS: set etcd.tls.clientSecret (ca.crt, and tls.crt/tls.key with clientCert) for masters and agents" }}
{{- end }}
{{- if and $e.auth.user (not $e.auth.existingSecret) }}
{{- fail "etcd.auth.user needs etcd.auth.existingSecret (the Secret holding the password)" }}
{{- end }}
{{- if and $e.auth.existingSecret (not $e.auth.user) }}
{{- fail "etcd.auth.existingSecret needs etcd.auth.user" }}
{{- end }}
{{- $m := .Values.master }}
{{- if and $m.apiKeys.existingSecret $m.serviceMonitor.enabled (kindIs "invalid" $m.adminPort) }}
{{- fail "master.apiKeys with master.serviceMonitor needs master.adminPort: Prometheus scrapes /metrics there without an API key" }}
{{- end }}
{{- end }}

{{- define "pdcoord.grpc.agentSecret" -}}
{{- default .Values.tls.grpc.existingSecret .Values.tls.grpc.agentSecret }}
{{- end }}

{{- define "pdcoord.grpc.serverName" -}}
{{- default (printf "%s.%s.svc" (include "pdcoord.componentName" (dict "root" . "component" "master-grpc")) .Release.Namespace) .Values.tls.grpc.serverName }}
{{- end }}

{{/* etcd TLS / auth flags, shared by pdmaster and nodeagent. */}}
{{- define "pdcoord.etcd.securityArgs" -}}
{{- $e := .Values.etcd }}
{{- if include "pdcoord.etcd.clientSecret" . }}
- --etcd-ca=/etc/pdcoord/etcd-tls/ca.crt
{{- if $e.tls.clientCert }}
- --etcd-cert=/etc/pdcoord/etcd-tls/tls.crt
- --etcd-key=/etc/pdcoord/etcd-tls/tls.key
{{- end }}
{{- end }}
{{- if $e.auth.user }}
- --etcd-user={{ $e.auth.user }}
- --etcd-password-file=/etc/pdcoord/etcd-auth/password
{{- end }}
{{- end }}

{{/* volumeMounts for the Secrets a component uses (component: master or nodeagent). */}}
{{- define "pdcoord.security.volumeMounts" -}}
{{- $root := .root }}
{{- if (eq .component "master" | ternary $root.Values.tls.grpc.existingSecret (include "pdcoord.grpc.agentSecret" $root)) }}
- name: pdcoord-grpc-tls
  mountPath: /etc/pdcoord/grpc-tls
  readOnly: true
{{- end }}
{{- if include "pdcoord.etcd.clientSecret" $root }}
- name: pdcoord-etcd-tls
  mountPath: /etc/pdcoord/etcd-tls
  readOnly: true
{{- end }}
{{- if $root.Values.etcd.auth.existingSecret }}
- name: pdcoord-etcd-auth
  mountPath: /etc/pdcoord/etcd-auth
  readOnly: true
{{- end }}
{{- if and (eq .component "master") $root.Values.master.apiKeys.existingSecret }}
- name: pdcoord-api-keys
  mountPath: /etc/pdcoord/api-keys
  readOnly: true
{{- end }}
{{- end }}

{{/* The pod volumes behind pdcoord.security.volumeMounts. */}}
{{- define "pdcoord.security.volumes" -}}
{{- $root := .root }}
{{- $grpc := eq .component "master" | ternary $root.Values.tls.grpc.existingSecret (include "pdcoord.grpc.agentSecret" $root) }}
{{- if $grpc }}
- name: pdcoord-grpc-tls
  secret:
    secretName: {{ $grpc }}
    defaultMode: 0440
{{- end }}
{{- with include "pdcoord.etcd.clientSecret" $root }}
- name: pdcoord-etcd-tls
  secret:
    secretName: {{ . }}
    defaultMode: 0440
{{- end }}
{{- with $root.Values.etcd.auth.existingSecret }}
- name: pdcoord-etcd-auth
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.etcd.auth.passwordKey }}
        path: password
{{- end }}
{{- if and (eq .component "master") $root.Values.master.apiKeys.existingSecret }}
- name: pdcoord-api-keys
  secret:
    secretName: {{ $root.Values.master.apiKeys.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $root.Values.master.apiKeys.key }}
        path: api-keys
{{- end }}
{{- end }}

{{/*
Volumes the nodeagent sidecar needs (TLS and etcd Secrets); add them to the engine pod next to
the container, e.g.
  volumes:
    {{- include "pdcoord.nodeagent.volumes" (dict "root" $) | nindent 4 }}
Renders nothing when no Secret is configured.
*/}}
{{- define "pdcoord.nodeagent.volumes" -}}
{{- include "pdcoord.security.volumes" (dict "root" .root "component" "nodeagent") }}
{{- end }}
