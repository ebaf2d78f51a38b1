"""The turn set's callers in languages other than English: sentences with the places where they cannot end.

Each language has what `voiced.bench.turn_set` draws an English caller from: templates whose `|` marks a
place where the sentence cannot end (after an article, a preposition, a conjunction, an auxiliary or
modal verb, or inside a number read out digit by digit, `{digits}`), the words that fill their slots, the
words a sentence cannot end on (`not_final`, which every pause is checked against), the digits, and
espeak-ng voices of the language. English lives in turn_set itself (its default, unchanged).

The end-of-turn rule's word lists are English: these callers are judged by the language-general signals
(Whisper's end-of-text and stop probabilities, the audio model, the silence), which is what a set in
another language measures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Language:
    code: str  # Whisper's and espeak-ng's language code
    templates: tuple[str, ...]
    words: dict[str, list[str]]
    digits: tuple[str, ...]  # zero to nine
    not_final: frozenset[str]  # words after which a sentence of the language does not end
    voices: tuple[str, ...]  # espeak-ng voices


GERMAN_DIGITS = ("null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun")
GERMAN = Language(
    "de",
    templates=(
        "Ich möchte einen Tisch für | {num} Personen am | {day} reservieren.",
        "Bitte schicken Sie das | Paket an | {place} {when}.",
        "Können Sie meinen Termin mit | {person} auf | {day} verschieben?",
        "Meine Kundennummer ist {digits}.",
        "Ich brauche ein Taxi vom | Bahnhof zum | {dest} um | {time}.",
        "Ich rufe an, weil | {problem}.",
        "Wir warten seit | {num} Tagen auf die | Lieferung.",
        "Gibt es eine Apotheke in der Nähe vom | Bahnhof, die nach | {time} geöffnet hat?",
        "Mein Bruder und | ich müssen | {when} zum | {dest}.",
        "Bitte lesen Sie mir die | Nummer vor, die mit {digits} endet.",
    ),
    words={
        "num": ["zwei", "drei", "vier", "fünf", "sechs", "acht", "zehn", "zwölf"],
        "day": ["Montag", "Dienstag", "Mittwoch", "Donnerstag", "Freitag", "Samstag"],
        "place": ["den Flughafen", "das Hauptbüro", "das Krankenhaus", "mein Hotel", "die Stadtbibliothek",
                  "den Nordeingang"],
        "when": ["morgen früh", "am Freitag", "nächste Woche", "vor Mittag", "heute Abend", "nach dem Mittagessen"],
        "person": ["Doktor Müller", "Frau Schmidt", "Herrn Weber", "dem Vermieter", "meinem Steuerberater"],
        "dest": ["Flughafen", "Hotel", "Krankenhaus", "Hauptbahnhof", "Rathaus"],
        "time": ["halb acht", "neun Uhr", "Viertel nach sechs", "zwölf Uhr", "Viertel vor fünf"],
        "problem": ["die Heizung kaputt ist", "die Zahlung nicht geklappt hat", "die Lieferung zu spät ist",
                    "die App ständig abstürzt", "die Rechnung falsch aussieht"],
    },
    digits=GERMAN_DIGITS,
    not_final=frozenset({
        "der", "die", "das", "den", "dem", "des", "ein", "eine", "einen", "einem", "einer", "mein", "meine",
        "meinen", "meinem", "unser", "unsere",
        "für", "mit", "an", "auf", "vom", "zum", "zur", "am", "um", "in", "von", "nach", "bei", "aus", "seit",
        "bis", "über", "unter", "vor",
        "und", "aber", "weil", "oder", "dass", "wenn", "denn",
        "ist", "bin", "sind", "habe", "hat", "werde", "wird", "kann", "muss", "müssen", "möchte", "soll",
    }) | frozenset(GERMAN_DIGITS),
    voices=("de", "de+f3", "de+m3", "de+f2"),
)

SPANISH_DIGITS = ("cero", "uno", "dos", "tres", "cuatro", "cinco", "seis", "siete", "ocho", "nueve")
SPANISH = Language(
    "es",
    templates=(
        "Quisiera reservar una mesa para | {num} personas el | {day}.",
        "Por favor, envíe el | paquete a | {place} {when}.",
        "¿Puede cambiar mi cita con | {person} para el | {day}?",
        "Mi número de cliente es {digits}.",
        "Necesito un taxi desde | {place} hasta | {place} a las | {time}.",
        "Llamo porque | {problem}.",
        "Estamos esperando el | pedido desde hace | {num} días.",
        "¿Hay una farmacia cerca de | {place} que abra después de | las {time}?",
        "Mi hermano y | yo vamos a | {place} {when}.",
        "Por favor, léame el | número que termina en {digits}.",
    ),
    words={
        "num": ["dos", "tres", "cuatro", "cinco", "seis", "ocho", "diez", "doce"],
        "day": ["lunes", "martes", "miércoles", "jueves", "viernes", "sábado"],
        "place": ["la oficina principal", "la estación de tren", "mi hotel", "la biblioteca", "la entrada norte",
                  "la calle mayor"],
        "when": ["mañana por la mañana", "el viernes", "la próxima semana", "antes del mediodía", "esta tarde",
                 "después de comer"],
        "person": ["el doctor García", "mi hermana", "el gerente", "la señora López", "mi contable"],
        "time": ["siete y media", "nueve", "seis y cuarto", "doce", "cinco menos cuarto"],
        "problem": ["la calefacción no funciona", "el pago no se procesó", "el pedido llegó tarde",
                    "la aplicación se cierra sola", "la factura parece incorrecta"],
    },
    digits=SPANISH_DIGITS,
    not_final=frozenset({
        "el", "la", "los", "las", "un", "una", "unos", "unas", "mi", "mis", "su", "sus", "nuestro", "nuestra",
        "a", "de", "para", "con", "en", "por", "desde", "hasta", "sin", "sobre", "entre", "al", "del", "hace",
        "y", "o", "pero", "porque", "que", "si", "cuando",
        "es", "está", "son", "he", "ha", "hemos", "puede", "quiero", "quisiera", "necesito", "vamos", "voy",
        "estamos",
    }) | frozenset(SPANISH_DIGITS),
    voices=("es", "es-419", "es+f3", "es-419+m3"),
)

LANGUAGES = {lang.code: lang for lang in (GERMAN, SPANISH)}
