{{/* Names ------------------------------------------------------------------------- */}}

{{- define "walcast.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's base name: the release name alone when it already says walcast. */}}
{{- define "walcast.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "walcast.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<suffix>, kept within 63 characters. Call with (list $ "suffix"). */}}
{{- define "walcast.component.fullname" -}}
{{- $root := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- printf "%s-%s" (include "walcast.fullname" $root | trunc (int (sub 62 (len $suffix)))) $suffix | trimSuffix "-" -}}
{{- end -}}

{{/* Labels ------------------------------------------------------------------------ */}}

{{- define "walcast.selectorLabels" -}}
app.kubernetes.io/name: {{ include "walcast.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "walcast.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "walcast.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: walcast
{{- end -}}

{{/* Selector labels of one component. Call with (list $ "cdc-worker"). */}}
{{- define "walcast.componentSelector" -}}
{{ include "walcast.selectorLabels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "walcast.componentLabels" -}}
{{ include "walcast.labels" (index . 0) }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{/* Images ------------------------------------------------------------------------ */}}

{{/* repository:tag[@digest]; the tag defaults to the chart's appVersion. Call with
     (list $ .Values.image). */}}
{{- define "walcast.imageRef" -}}
{{- $root := index . 0 -}}
{{- $img := index . 1 -}}
{{- $tag := default $root.Chart.AppVersion $img.tag | toString -}}
{{- if eq $tag "latest" -}}
{{- fail "image tags must be pinned: `latest` is not accepted" -}}
{{- end -}}
{{- if $img.digest -}}
{{- printf "%s:%s@%s" $img.repository $tag $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Secrets ------------------------------------------------------------------------ */}}

{{/* Whether the chart writes the Secret: no existingSecret, and some value given. */}}
{{- define "walcast.createSecret" -}}
{{- $s := .Values.secrets -}}
{{- if and (not $s.existingSecret) (or $s.jwtSecret $s.databaseUrl $s.replicationUrl $s.checkDatabaseUrl $s.postgresPassword $s.checkPassword $s.natsUrl $s.secretsKey $s.secretsKeyPrevious $s.metricsApiKey) -}}
true
{{- end -}}
{{- end -}}

{{/* SECRETS_KEY and SECRETS_KEY_PREVIOUS (optional) from the Secret, as env entries. */}}
{{- define "walcast.secretsKeyEnv" -}}
- name: SECRETS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "walcast.secretName" . }}
      key: {{ .Values.secrets.keys.secretsKey }}
# Optional: set only while the key rotates.
- name: SECRETS_KEY_PREVIOUS
  valueFrom:
    secretKeyRef:
      name: {{ include "walcast.secretName" . }}
      key: {{ .Values.secrets.keys.secretsKeyPrevious }}
      optional: true
{{- end -}}

{{/* The Secret the pods read: yours, else the one named like the release. */}}
{{- define "walcast.secretName" -}}
{{- default (include "walcast.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{/* Pod annotations: a checksum of the chart's Secret (pods restart when it changes)
     plus the given ones, as YAML; empty when there are none. Call with (list $ annotations). */}}
{{- define "walcast.podAnnotations" -}}
{{- $root := index . 0 -}}
{{- $all := dict -}}
{{- if include "walcast.createSecret" $root -}}
{{- $_ := set $all "checksum/secret" (include (print $root.Template.BasePath "/secret.yaml") $root | sha256sum) -}}
{{- end -}}
{{- $all = merge $all (index . 1 | default dict) -}}
{{- with $all -}}
{{- toYaml . -}}
{{- end -}}
{{- end -}}

{{/* Service names of the bundled dependencies. */}}
{{- define "walcast.nats.fullname" -}}
{{- include "walcast.component.fullname" (list . "nats") -}}
{{- end -}}
{{- define "walcast.postgresql.fullname" -}}
{{- include "walcast.component.fullname" (list . "postgresql") -}}
{{- end -}}

{{/* The bundled NATS's users' passwords (files/walcast-permissions.conf). */}}
{{- define "walcast.nats.usersSecret" -}}
{{- include "walcast.component.fullname" (list . "nats-users") -}}
{{- end -}}

{{/* The NATS_URL env entry (bundled, a plain URL, or a key of the Secret); with the
bundled NATS also NATS_USER and NATS_PASSWORD of the role ("worker" or "front"). */}}
{{- define "walcast.natsUrlEnv" -}}
{{- $ := index . 0 -}}
{{- $role := index . 1 -}}
- name: NATS_URL
{{- if $.Values.nats.enabled }}
  value: {{ printf "nats://%s.%s.svc:4222" (include "walcast.nats.fullname" $) $.Release.Namespace | quote }}
- name: NATS_USER
  value: {{ printf "walcast-%s" $role | quote }}
- name: NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "walcast.nats.usersSecret" $ }}
      key: {{ $role }}
{{- else if $.Values.nats.url }}
  value: {{ $.Values.nats.url | quote }}
{{- else }}
  valueFrom:
    secretKeyRef:
      name: {{ include "walcast.secretName" $ }}
      key: {{ $.Values.secrets.keys.natsUrl }}
{{- end }}
{{- end -}}

{{/* Settings every walcast container gets. */}}
{{- define "walcast.commonEnv" -}}
- name: PORT
  value: {{ .Values.port | quote }}
- name: LOG_FORMAT
  value: {{ .Values.log.format | quote }}
- name: LOG_LEVEL
  value: {{ .Values.log.level | quote }}
{{- end -}}

{{/* Resources ---------------------------------------------------------------------- */}}

{{/* The front's memory request in MiB: base + maxConnections × KiB per connection. */}}
{{- define "walcast.front.memoryRequestMiB" -}}
{{- $m := .Values.front.memory -}}
{{- $perConnKiB := mul (int .Values.front.maxConnections) (int $m.perConnectionKiB) -}}
{{- add (int $m.baseMiB) (div (add $perConnKiB 1023) 1024) -}}
{{- end -}}

{{- define "walcast.front.resources" -}}
{{- if .Values.front.resources -}}
{{- toYaml .Values.front.resources -}}
{{- else -}}
{{- $req := include "walcast.front.memoryRequestMiB" . | int -}}
{{- $lim := div (mul $req (int .Values.front.memory.limitPercent)) 100 -}}
requests:
  cpu: {{ .Values.front.cpu.request | quote }}
  memory: {{ printf "%dMi" $req }}
limits:
  memory: {{ printf "%dMi" $lim }}
{{- end -}}
{{- end -}}

{{/* The front's grace period: preStop sleep + drain window + 15 s margin. */}}
{{- define "walcast.front.gracePeriod" -}}
{{- if .Values.front.terminationGracePeriodSeconds -}}
{{- .Values.front.terminationGracePeriodSeconds -}}
{{- else -}}
{{- add (int .Values.front.preStopSleepSeconds) (int .Values.front.drainSeconds) 15 -}}
{{- end -}}
{{- end -}}

{{/* The Lease of the election (Kubernetes mode): lease.name, else the slot name made a
     DNS name, so workers on the same slot in a namespace still compete. */}}
{{- define "walcast.leaseName" -}}
{{- default (.Values.worker.slotName | replace "_" "-") .Values.worker.lease.name -}}
{{- end -}}

{{/* Service accounts ---------------------------------------------------------------- */}}

{{- define "walcast.worker.serviceAccountName" -}}
{{- if .Values.worker.serviceAccount.create -}}
{{- default (include "walcast.component.fullname" (list . "cdc-worker")) .Values.worker.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.worker.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "walcast.front.serviceAccountName" -}}
{{- if .Values.front.serviceAccount.create -}}
{{- default (include "walcast.component.fullname" (list . "ws-front")) .Values.front.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.front.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Spread replicas over nodes (soft) unless the values give constraints. Call with
     (list $ "component" .Values.<component>.topologySpreadConstraints). */}}
{{- define "walcast.topologySpread" -}}
{{- $root := index . 0 -}}
{{- $component := index . 1 -}}
{{- $given := index . 2 -}}
{{- if $given -}}
{{- toYaml $given -}}
{{- else -}}
- maxSkew: 1
  topologyKey: kubernetes.io/hostname
  whenUnsatisfiable: ScheduleAnyway
  labelSelector:
    matchLabels:
      {{- include "walcast.componentSelector" (list $root $component) | nindent 6 }}
{{- end -}}
{{- end -}}
