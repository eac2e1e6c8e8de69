{{/* What each component talks to; the NetworkPolicy allows exactly these. */}}
{{- define "rtrl.dependencies" -}}
{{- $deps := dict
  "gateway" (list "kafka" "redis" "mlflow" "engine")
  "ingest" (list "kafka" "redis")
  "reward" (list "kafka" "redis")
  "trainer" (list "kafka" "redis" "mlflow" "ray")
  "deployer" (list "kafka" "redis" "mlflow" "engine" "notify") }}
{{- index $deps . | join "," }}
{{- end }}

{{/* NetworkPolicy of one component: (dict "root" $ "component" NAME) */}}
{{- define "rtrl.networkPolicy" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $np := $v.networkPolicy }}
{{- $ctx := dict "root" $root "component" .component }}
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: {{ include "rtrl.componentName" $ctx }}
  labels:
    {{- include "rtrl.componentLabels" $ctx | nindent 4 }}
spec:
  podSelector:
    matchLabels:
      {{- include "rtrl.selectorLabels" $ctx | nindent 6 }}
  policyTypes: ["Ingress", "Egress"]
  ingress:
    - ports:
        - port: {{ ternary "http" "metrics" (eq .component "gateway") }}
          protocol: TCP
      {{- with $np.metricsFrom }}
      from:
        {{- toYaml . | nindent 8 }}
        {{- if $v.tests.enabled }}
        # the helm test pods (templates/tests/) check /readyz here
        - podSelector:
            matchLabels:
              {{- include "rtrl.selectorLabels" (dict "root" $root "component" "helm-test") | nindent 14 }}
        {{- end }}
      {{- end }}
    {{- if eq .component "gateway" }}
    - ports:
        - port: http
          protocol: TCP
      {{- with $v.gateway.allowedClients }}
      from:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
  egress:
    - ports:
        {{- range $np.egress.dns.ports }}
        - port: {{ . }}
          protocol: UDP
        - port: {{ . }}
          protocol: TCP
        {{- end }}
      {{- with $np.egress.dns.to }}
      to:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- range $dep := splitList "," (include "rtrl.dependencies" .component) }}
    {{- if and (eq $dep "ray") $v.ray.cluster.enabled }}
    - ports:
        - port: 10001
          protocol: TCP
        - port: 8265
          protocol: TCP
        - port: 6379
          protocol: TCP
      to:
        - podSelector:
            matchLabels:
              ray.io/cluster: {{ include "rtrl.rayClusterName" $root }}
    {{- else if and (eq $dep "ray") (not $v.ray.address) }}
    {{- /* Ray runs inside the trainer pod: nothing to reach */}}
    {{- else if and (eq $dep "notify") (not (include "rtrl.notifies" $root)) }}
    {{- /* no webhooks: nothing to reach */}}
    {{- else if eq $dep "notify" }}
    {{- with $v.deployer.notifications.egress }}
    - ports:
        {{- range .ports }}
        - port: {{ . }}
          protocol: TCP
        {{- end }}
      {{- with .to }}
      to:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
    {{- else if and (eq $dep "engine") (ne $v.engine.kind "vllm") }}
    {{- /* the local engine runs inside the gateway: nothing to reach */}}
    {{- else if and (eq $dep "engine") $v.engine.vllm.enabled (not $v.engine.baseUrl) }}
    - ports:
        - port: {{ $v.engine.vllm.port }}
          protocol: TCP
      to:
        - podSelector:
            matchLabels:
              {{- include "rtrl.selectorLabels" (dict "root" $root "component" "vllm") | nindent 14 }}
    {{- else }}
    {{- $rule := index $np.egress $dep }}
    - ports:
        {{- range $rule.ports }}
        - port: {{ . }}
          protocol: TCP
        {{- end }}
      {{- with $rule.to }}
      to:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    {{- end }}
    {{- end }}
    {{- with $np.egress.extra }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/* PodDisruptionBudget of one component */}}
{{- define "rtrl.pdb" -}}
{{- $ctx := dict "root" .root "component" .component }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "rtrl.componentName" $ctx }}
  labels:
    {{- include "rtrl.componentLabels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ (index .root.Values .component).pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "rtrl.selectorLabels" $ctx | nindent 6 }}
{{- end }}

{{/* HorizontalPodAutoscaler of one worker component */}}
{{- define "rtrl.hpa" -}}
{{- $ctx := dict "root" .root "component" .component }}
{{- $a := (index .root.Values .component).autoscaling }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail (printf "%s.autoscaling: minReplicas (%v) is above maxReplicas (%v)" .component $a.minReplicas $a.maxReplicas) }}
{{- end }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "rtrl.componentName" $ctx }}
  labels:
    {{- include "rtrl.componentLabels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "rtrl.componentName" $ctx }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCpuUtilizationPercentage }}
  behavior:
    scaleDown:
      # Each scale-down rebalances the consumer group: do it slowly.
      stabilizationWindowSeconds: 600
{{- end }}
