// The page: sign in by name (the example server signs the token), then supabase-js against
// walcast — the user's todos as they change (postgres_changes, filtered by walcast with the
// table's row-level security), who is online in the lobby (presence on a private channel),
// and waves (broadcast). Writes go to the example server, which runs them as the user.
const $ = (id) => document.getElementById(id)
const config = await (await fetch('/config.json')).json()
let session = null
const todos = new Map()

/** Call the example server's API as the signed-in user. */
async function callApi(method, path, body) {
  const r = await fetch(path, {
    method,
    headers: { 'content-type': 'application/json', ...(session ? { authorization: `Bearer ${session.token}` } : {}) },
    body: body === undefined ? undefined : JSON.stringify(body),
  })
  const answer = r.status === 204 ? null : await r.json()
  if (!r.ok) throw new Error(answer?.error || `${method} ${path}: ${r.status}`)
  return answer
}

function renderTodos() {
  const list = $('todos')
  list.replaceChildren(
    ...[...todos.values()].sort((a, b) => a.id - b.id).map((todo) => {
      const li = document.createElement('li')
      li.dataset.id = todo.id
      li.className = todo.done ? 'done' : ''
      const box = document.createElement('input')
      box.type = 'checkbox'
      box.checked = todo.done
      box.onchange = () => callApi('PATCH', `/api/todos/${todo.id}`, { done: box.checked }).catch(notice)
      const title = document.createElement('span')
      title.textContent = todo.title
      const remove = document.createElement('button')
      remove.textContent = 'delete'
      remove.onclick = () => callApi('DELETE', `/api/todos/${todo.id}`).catch(notice)
      li.append(box, ' ', title, remove)
      return li
    }),
  )
}

function renderOnline(state) {
  const names = Object.values(state).map((metas) => metas[0]?.name).filter(Boolean).sort()
  $('online').replaceChildren(...names.map((name) => Object.assign(document.createElement('li'), { textContent: name })))
}

function addEvent(text) {
  $('events').prepend(Object.assign(document.createElement('li'), { textContent: text }))
}

function notice(e) {
  $('notice').textContent = e instanceof Error ? e.message : String(e)
}

/** Channel statuses, shown on the page (and read by its test). */
function status(channel, value, err) {
  document.body.dataset[channel] = value
  if (err) notice(`${channel}: ${err.message || err}`)
  const both = document.body.dataset.todos === 'SUBSCRIBED' && document.body.dataset.lobby === 'SUBSCRIBED'
  $('status').textContent = both ? 'live' : `${channel}: ${value.toLowerCase()}`
}

async function start() {
  const client = supabase.createClient(config.url, config.anonKey, { auth: { persistSession: false, autoRefreshToken: false } })
  // The user's token before the first subscribe: every join carries it.
  await client.realtime.setAuth(session.token)

  client
    .channel(`todos:${session.user.id}`)
    .on('postgres_changes', { event: '*', schema: 'public', table: 'example_todos' }, (change) => {
      if (change.eventType === 'DELETE') todos.delete(change.old.id)
      else todos.set(change.new.id, change.new)
      renderTodos()
    })
    // walcast's own notices (a change that could not be judged, a missing grant) arrive here.
    .on('system', {}, (message) => message.status !== 'ok' && notice(message.message))
    .subscribe(async (value, err) => {
      status('todos', value, err)
      // Listening first, then reading: a row written in between is in one or the other.
      if (value === 'SUBSCRIBED') {
        for (const todo of await callApi('GET', '/api/todos')) todos.set(todo.id, todo)
        renderTodos()
      }
    })

  const lobby = client.channel('room:lobby', {
    config: { private: true, presence: { key: session.user.id }, broadcast: { self: false } },
  })
  lobby
    .on('presence', { event: 'sync' }, () => renderOnline(lobby.presenceState()))
    .on('broadcast', { event: 'wave' }, ({ payload }) => addEvent(`${payload.name} waves`))
    .subscribe(async (value, err) => {
      status('lobby', value, err)
      if (value === 'SUBSCRIBED') await lobby.track({ name: session.user.name })
    })
  $('wave').onclick = async () => {
    const answer = await lobby.send({ type: 'broadcast', event: 'wave', payload: { name: session.user.name } })
    addEvent(answer === 'ok' ? 'you waved' : `your wave was not sent (${answer})`)
  }
}

$('signin').onsubmit = async (e) => {
  e.preventDefault()
  try {
    session = await callApi('POST', '/api/session', { name: $('name').value })
  } catch (err) {
    $('signin-error').textContent = err.message
    return
  }
  $('signin').hidden = true
  $('app').hidden = false
  $('me').textContent = session.user.name
  start().catch(notice)
}

$('add').onsubmit = async (e) => {
  e.preventDefault()
  const title = $('title').value
  $('title').value = ''
  // The new row appears through the change walcast streams back, like any other change.
  await callApi('POST', '/api/todos', { title }).catch(notice)
}
